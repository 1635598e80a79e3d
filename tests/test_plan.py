"""`shardwise plan`: predictions against real 2-process runs, extrapolation against full traces,
the library call `Engine(strategy="auto")` makes, the command line and its errors.

The measured side counts live tensor storage in real training (a dispatch mode written here,
independent of the planner's), on 2 gloo processes, over two steps of the same loop the planner
traces: `out = model(**batch)`, `engine.backward(out.loss)`, `optimizer.step()`, `zero_grad()`.
"""

from __future__ import annotations

import functools
import json
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from spawn import spawn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

from shardwise import cli
from shardwise.config import plan_choices
from shardwise.plan import CANDIDATES, Candidate, Plan, PlanRequest, parse_memory, plan_model, plan_module
from shardwise.plan.fakes import fake_mode
from shardwise.plan.fit import Overheads
from shardwise.plan.floor import ModelBytes, state_floor
from shardwise.plan.presets import PlanError, hf_spec
from shardwise.plan.report import describe

TOLERANCE = 0.05
PLAIN = [c for c in CANDIDATES if not c.checkpointed]  # every pair the strategy table allows
# the six the planner compared before it read the table (the ~100M runs keep to these, for time)
SIX = [Candidate("ddp"), Candidate("zero1"), Candidate("zero2"), Candidate("zero3"),
       Candidate("zero2", "optimizer"), Candidate("zero3", "params")]
# the two the table allowed and the hand list left out
TABLE_ONLY = [Candidate("zero1", "optimizer"), Candidate("zero3", "optimizer")]
AC = [Candidate("ddp", "none", True), Candidate("zero2", "optimizer", True),
      Candidate("zero3", "params", True)]

# name -> (config class, model class, config keywords, sequence length, per-device batch)
MODELS: dict[str, tuple[str, str, dict[str, Any], int, int]] = {
    "gpt2-tiny": ("GPT2Config", "GPT2LMHeadModel",
                  {"vocab_size": 96, "n_positions": 32, "n_embd": 32, "n_layer": 3, "n_head": 2}, 16, 2),
    "deberta-tiny": ("DebertaV2Config", "DebertaV2ForSequenceClassification",
                     {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
                          "intermediate_size": 64, "max_position_embeddings": 64, "num_labels": 2,
                          "relative_attention": True, "position_buckets": 16,
                          "pos_att_type": ["p2c", "c2p"]}, 16, 2),
    # ~100M parameters each; deep enough that the planner traces 3 and 4 blocks and extrapolates
    "gpt2-96m": ("GPT2Config", "GPT2LMHeadModel",
                 {"vocab_size": 50257, "n_positions": 64, "n_embd": 768, "n_layer": 8, "n_head": 12}, 32, 1),
    "deberta-92m": ("DebertaV2Config", "DebertaV2ForSequenceClassification",
                    {"vocab_size": 64000, "hidden_size": 768, "num_hidden_layers": 6,
                         "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 128,
                         "num_labels": 2, "relative_attention": True, "position_buckets": 32,
                         "pos_att_type": ["p2c", "c2p"]}, 32, 1),
}
_NO_DROPOUT = {"GPT2Config": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
               "DebertaV2Config": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}


def _spec(name: str) -> Any:
    import transformers

    cfg_cls, arch, kw, seq, _ = MODELS[name]
    cfg = getattr(transformers, cfg_cls)(**kw, **_NO_DROPOUT[cfg_cls])
    return hf_spec(name, cfg, arch, seq)


# -- the measured side ------------------------------------------------------------------------
class LiveStorage(TorchDispatchMode):
    """Bytes of live tensor storage: each storage counted once, re-read after in-place ops and
    `UntypedStorage.resize_`, dropped when its last reference dies."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.now = self.peak = 0
        self._resize = torch.UntypedStorage.resize_

    def storage(self, st: torch.UntypedStorage) -> None:
        key, n = st._cdata, st.nbytes()
        if key not in self.sizes:
            self.refs[key] = weakref.ref(st, functools.partial(self._drop, key))
            self.sizes[key] = 0
        self.now += n - self.sizes[key]
        self.sizes[key] = n
        self.peak = max(self.peak, self.now)

    def _drop(self, key: int, _ref: Any) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def tensor(self, t: torch.Tensor) -> None:
        self.storage((t._local_tensor if isinstance(t, DTensor) else t).untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tensor(t)
        return out

    def __enter__(self) -> Self:
        original, counter = self._resize, self

        def resize_(st: torch.UntypedStorage, n: int) -> Any:
            result = original(st, n)
            counter.storage(st)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)


def _optimizer(name: str) -> Any:
    """AdamW for the tiny models; SGD with momentum (one state tensor) at ~100M, which halves the
    optimizer's share of the suite's time on 2 cores while still holding optimizer state."""
    if name.endswith("m"):
        return lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-4)


def _measure(name: str, candidates: list[Candidate], steps: int = 2) -> list[int]:
    """Per-rank peak of live tensor bytes over `steps` real training steps, per candidate."""
    import copy
    import gc

    import shardwise

    spec = _spec(name)
    batch = MODELS[name][4]
    torch.manual_seed(0)
    template = spec.build(None)  # initialised once; each run trains a copy
    peaks = []
    for cand in candidates:
        engine = shardwise.Engine(strategy=cand.strategy, offload=cand.offload, cpu=True,
                                  activation_checkpointing=cand.activation_checkpointing)
        model = copy.deepcopy(template)
        optimizer = _optimizer(name)(model.parameters())
        peaks.append(peak_of_steps(engine, model, optimizer, lambda: spec.make_batch(batch), steps))
        del model, optimizer, engine
        gc.collect()
    return peaks


def peak_of_steps(engine: Any, model: Any, optimizer: Any, make_batch: Any, steps: int) -> int:
    """Peak live tensor bytes of `steps` training steps (`out = model(**batch)`, `engine.backward(
    out.loss)`, `step`, `zero_grad`) after `engine.prepare(model, optimizer)`, prepare's own peak
    left out (the model's tensors counted from the start)."""
    live = LiveStorage()
    for t in list(model.parameters()) + list(model.buffers()):
        live.tensor(t)
    with live:
        model, optimizer = engine.prepare(model, optimizer)
        live.peak = live.now  # the training steps' peak, not prepare's
        out = None
        for _ in range(steps):
            batch_data = make_batch()
            out = model(**batch_data)
            loss = out.loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        del out, loss, batch_data
    return live.peak


def _predict(name: str, candidates: list[Candidate]) -> Plan:
    request = PlanRequest(world_size=2, device_memory="1TB", batch=MODELS[name][4], device="cpu",
                          candidates=candidates, workers=2, optimizer=_optimizer(name))
    return plan_model(_spec(name), request)


def _check(name: str, candidates: list[Candidate], measured: list[int], plan: Plan) -> list[str]:
    report = []
    for cand, real in zip(candidates, measured):
        predicted = plan.find(cand.strategy, cand.offload, cand.activation_checkpointing).peak
        err = predicted / real - 1
        report.append(f"{name:13s} {cand.name:31s} predicted {predicted / 2**20:9.2f} MiB  "
                      f"measured {real / 2**20:9.2f} MiB  {err:+.2%}")
        assert abs(err) <= TOLERANCE, "\n".join(report)
    print("\n".join(report))
    return report


SIZES = {"tiny": ("gpt2-tiny", "deberta-tiny"), "100m": ("gpt2-96m", "deberta-92m")}


@pytest.mark.parametrize("size", ["tiny", "100m"])  # 100m: ~2.5 minutes of the suite's 10 on 2 cores
def test_predicted_peak_matches_real_two_process_runs(size: str) -> None:
    """Every strategy within 5%, for GPT-2 and DeBERTa-v2 at a tiny size and at ~100M parameters
    (the tiny GPT-2 also with activation checkpointing, three ways); one spawn measures each size.
    The tiny models run every candidate the strategy table allows, zero1 and zero3 with optimizer
    offload included (`TABLE_ONLY`); the ~100M ones the six the planner had before."""
    names = SIZES[size]
    plain = PLAIN if size == "tiny" else SIX
    assert size != "tiny" or set(TABLE_ONLY) <= set(plain)
    cands = {n: plain + AC if n == "gpt2-tiny" else plain for n in names}
    measured = spawn(_measure_all, 2, cands)
    for n in names:
        for rank in (0, 1):
            assert len(measured[rank][n]) == len(cands[n])
        plan = _predict(n, cands[n])
        # rank 0 is the one the planner models (it holds the full chunk where shards are uneven)
        _check(n, cands[n], measured[0][n], plan)


def _measure_all(cands: dict[str, list[Candidate]]) -> dict[str, list[int]]:
    return {n: _measure(n, c) for n, c in cands.items()}


def test_candidates_are_what_the_strategy_table_allows() -> None:
    """Every (strategy, offload) pair of the table, without and with (full) activation checkpointing
    (the other modes are planned when asked for: `PlanRequest(activation_checkpointing=...)`);
    zero1 and zero3 with optimizer offload among them; the simpler first (ties in step time go
    to the first listed), so the six the planner had before keep their order."""
    pairs = {(c.strategy, c.offload) for c in CANDIDATES}
    assert pairs == set(plan_choices("torch")) and len(CANDIDATES) == 2 * len(pairs)
    assert set(TABLE_ONLY) <= set(PLAIN)
    assert [c for c in PLAIN if c in SIX] == SIX
    assert [c.activation_checkpointing for c in CANDIDATES] == ["none"] * len(pairs) + ["full"] * len(pairs)
    assert Candidate("ddp", "none", True) in CANDIDATES and Candidate("ddp", "none", False) in CANDIDATES
    offloaded = [c.offload_spec.any for c in PLAIN]
    assert offloaded == sorted(offloaded)  # nothing offloaded first
    assert {c.name for c in TABLE_ONLY} == {"zero1 + offload optimizer", "zero3 + offload optimizer"}


# -- candidates not traced: the optimizer step's floor ---------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_candidate_is_left_untraced_only_where_its_floor_overflows(device: str) -> None:
    """The floor (`plan.floor`: parameters, gradients and AdamW state at the optimizer step) is
    below every traced peak, for every candidate the table allows at 2 devices, their tp 2 twins
    included; a device between the smallest and the largest floor leaves exactly the candidates
    over it untraced (reported fits=False, max_batch 0, the floor as a lower bound), and a full
    trace of those confirms that none of them fits even batch 1. (On a CPU target, where offload
    moves nothing off the device, the floor alone is checked, without checkpointing twins.)"""
    spec = _spec("gpt2-tiny")
    every = PlanRequest(world_size=2, device_memory="1TB", device=device, workers=2, tensor_parallel_size=2,
                        activation_checkpointing=None if device == "cuda" else "none")
    roomy = plan_model(spec, every)
    assert all(p.traced for p in roomy.plans)
    with fake_mode():
        sizes = ModelBytes.of(spec.build(None))
    floors = {p.candidate: sum(state_floor(p.candidate, sizes, world_size=2, device=device,
                                           adam=True).values()) for p in roomy.plans}
    for p in roomy.plans:
        tensors = p.peak - p.breakdown["overhead"]
        assert floors[p.candidate] <= tensors, (p.name, floors[p.candidate], tensors)
    if device == "cpu":
        return
    overhead = Overheads()
    frag, fixed = overhead.frag(device), overhead.fixed(device, 2)
    distinct = sorted(set(floors.values()))
    low, high = distinct[len(distinct) // 2 - 1], distinct[len(distinct) // 2]
    limit = int((low + high) / 2 * (1 + frag) + fixed)
    tight = plan_model(spec, replace(every, device_memory=limit))
    skipped = {p.candidate for p in tight.plans if not p.traced}
    assert skipped == {c for c, f in floors.items() if f * (1 + frag) + fixed > limit} and skipped
    for p in tight.plans:
        if not p.traced:
            assert not p.fits and p.max_batch == 0 and p.peak > limit
            assert p.peak == pytest.approx(floors[p.candidate] * (1 + frag) + fixed)
            assert roomy.find(p.candidate.strategy, p.candidate.offload, p.candidate.activation_checkpointing,
                              tensor_parallel_size=p.candidate.tensor_parallel_size).peak > limit
    assert ">" in describe(tight) and "not traced" in describe(tight)


# -- extrapolation against a full trace -----------------------------------------------------------
def test_depth_and_batch_extrapolation_match_a_full_trace() -> None:
    """Traced at 3 and 4 blocks and batches 1 and 2, predicted at 8 blocks and batches 8, 16."""
    import transformers

    from shardwise.plan.fit import Fitted
    from shardwise.plan.planner import _trace_candidates
    from shardwise.plan.trace import TraceJob, run_trace

    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=8, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    spec = hf_spec("gpt2-8", cfg, "GPT2LMHeadModel", 32)
    cands = [Candidate("ddp"), Candidate("zero3", "params", True)]
    request = PlanRequest(world_size=2, device_memory="1TB", device="cpu", workers=2)
    traces = _trace_candidates(spec, cands, request, batch=1, grad_accum_steps=1)
    for cand in cands:
        fitted = Fitted(traces[cand], spec.depth, (3, 4), 2, "cpu")
        full = run_trace(TraceJob(build=lambda: spec.build(None), make_batch=spec.make_batch,
                                  loss_fn=spec.loss_fn, candidate=cand, world_size=2, batches=(8, 16)))
        for b in (8, 16):
            real = max(p.total for p in full[b].total.values())
            assert fitted.memory(b).device == pytest.approx(real, rel=1e-3), (cand.name, b)


# -- the library call behind Engine(strategy="auto") -----------------------------------------------
def _plan_inside_a_job() -> dict[str, Any]:
    """plan_module on the user's real model, inside a running 2-process gloo job."""
    import torch.distributed as dist

    import shardwise

    engine = shardwise.Engine(strategy="ddp", cpu=True)  # the real process group
    torch.manual_seed(1)
    spec = _spec("gpt2-tiny")
    model = spec.build(None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cands = [Candidate("ddp"), Candidate("zero3"), Candidate("zero3", "params", True)]
    request = PlanRequest(world_size=2, device_memory="64MB", device="cpu", candidates=cands)
    plan = plan_module(model, spec.make_batch(2), request)
    same_rng = bool(torch.equal(rng, torch.get_rng_state()))
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the job's own process group and its registry still work (a collective, a DTensor op)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    dt = torch.distributed.tensor.distribute_tensor(torch.arange(4.0), mesh)
    full = dt.full_tensor()
    del engine
    return {"best": plan.best.name if plan.best else None, "why": plan.why, "sum": t.item(),
            "full": full.tolist(), "rng": same_rng, "unchanged": unchanged, "world": dist.get_world_size(),
            "peaks": [p.peak for p in plan.plans]}


def test_plan_module_inside_a_running_job_leaves_it_intact() -> None:
    a, b = spawn(_plan_inside_a_job, 2)
    assert a["sum"] == b["sum"] == 3.0 and a["full"] == [0.0, 1.0, 2.0, 3.0] and a["world"] == 2
    assert a["rng"] and b["rng"] and a["unchanged"] and b["unchanged"]
    assert a["best"] == b["best"] and a["peaks"] == b["peaks"]  # every rank makes the same choice
    assert a["best"] is not None and a["best"] in a["why"]


# -- the command line -------------------------------------------------------------------------------
def _tiny_config(tmp_path: Path, layers: int = 5) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_positions": 64,
        "n_embd": 64, "n_layer": layers, "n_head": 2,
    }))
    return path


def test_cli_plans_a_config_json_writes_a_loadable_config_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardwise.config.files import load_config

    cfg = _tiny_config(tmp_path)
    out, png = tmp_path / "shardwise.yaml", tmp_path / "plan.png"
    code = cli.main(["plan", "--model", str(cfg), "--seq-len", "32", "--batch", "2", "--gpus", "2",
                     "--gpu-memory", "64MB", "--cuda-context", "1MB", "--nccl-buffers", "1MB",
                     "--no-activation-checkpointing", "--global-batch", "16", "--write", str(out),
                     "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "best: " in text and "global batch 16 = " in text
    assert "traced on fake tensors at 3 and 4 blocks" in text
    loaded = load_config(out)
    assert loaded.launch.num_processes == 2 and loaded.strategy in ("ddp", "zero1", "zero2", "zero3")
    assert isinstance(loaded.micro_batch_size, int)
    assert loaded.micro_batch_size * loaded.grad_accum_steps * 2 == 16
    assert png.stat().st_size > 1000


def test_global_batch_needs_accumulation_when_the_batch_does_not_fit() -> None:
    """Traced again with accumulation (gradients persist between micro-steps); the suggestion
    multiplies out to the global batch and fits."""
    spec = _spec("gpt2-tiny")
    small = plan_model(spec, PlanRequest(world_size=2, device_memory="1MB", batch=1, device="cpu",
                                         candidates=[Candidate("zero3")], global_batch=64, workers=2))
    g = small.global_batch
    assert g is not None and g.micro_batch * g.grad_accum_steps * 2 == 64 and g.grad_accum_steps > 1
    assert g.plan.fits and g.plan.peak <= 2**20 and g.plan.max_batch >= g.micro_batch


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt3"], "unknown model 'gpt3'; presets: gpt2, gpt2-medium"),
        (["--model", "gpt2", "--gpu-memory", "24XB"], "'24XB' is not a memory size"),
        (["--model", "gpt2", "--seq-len", "4096"],
         "--seq-len 4096 is longer than gpt2 allows (1024 positions)"),
        (["--model", "gpt2", "--gpus", "0"], "--gpus 0: plan for at least 1 device"),
    ],
)
def test_cli_refuses_bad_input_in_one_line_before_tracing(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.plan import planner

    monkeypatch.setattr(planner, "_trace_candidates", lambda *a, **k: pytest.fail("traced despite bad input"))
    argv = ["plan", "--gpu-memory", "24GB", *args] if "--gpu-memory" not in args else ["plan", *args]
    t0 = time.perf_counter()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert time.perf_counter() - t0 < 20


def test_memory_sizes() -> None:
    assert parse_memory("24GB") == parse_memory("24GiB") == parse_memory("24 g") == 24 * 2**30
    assert parse_memory("512MB") == 512 * 2**20 and parse_memory("1.5T") == int(1.5 * 2**40)
    assert parse_memory(1000) == 1000
    for bad in ("24XB", "GB", "-1GB", "0GB", ""):
        with pytest.raises(PlanError, match="memory"):
            parse_memory(bad, "--gpu-memory")


# -- Engine(strategy="auto") ------------------------------------------------------------------------
def _auto_runs() -> dict[str, Any]:
    """The equivalence loop under strategy="auto": with this machine's memory, with a device
    budget only sharded plans fit, and with one nothing fits."""
    import workloads as W

    import shardwise
    from shardwise.plan import auto

    def run() -> dict[str, Any]:
        engine = shardwise.Engine(strategy="auto", cpu=True, grad_accum_steps=2, seed=W.SEED)
        trained = W.run_loop(engine, "gpt2", batch=2, steps=4)
        return {"trained": trained, "chosen": engine.plan.best.name,
                "peaks": {p.name: p.peak for p in engine.plan.plans}}

    roomy = run()
    peaks = roomy["peaks"]
    budget = int((min(peaks.values()) + peaks["ddp"]) / 2)  # below ddp's peak, above the smallest
    auto.device_memory = lambda info: budget
    tight = run()
    auto.device_memory = lambda info: 1024
    try:
        run()
        refused = ""
    except shardwise.ConfigError as err:
        refused = str(err)
    return {"roomy": roomy, "tight": tight, "budget": budget, "refused": refused}


def test_engine_auto_picks_the_fastest_plan_that_fits_and_trains_the_same_model() -> None:
    import workloads as W

    a, b = spawn(_auto_runs, 2)
    ref = W.reference("gpt2", world=2, batch=2, accum=2, steps=4)
    assert a["roomy"]["chosen"] == "ddp"  # everything fits: the fastest
    tight = a["tight"]
    assert tight["chosen"] != "ddp" and tight["peaks"][tight["chosen"]] <= a["budget"] < tight["peaks"]["ddp"]
    assert b["tight"]["chosen"] == tight["chosen"]  # every rank chose the same
    for run in (a["roomy"], tight):
        assert W.close(run["trained"].losses, ref.losses) < 1e-5
        assert W.max_diff(run["trained"].state, ref.state) < 2e-5
    assert a["refused"].startswith("strategy='auto': no strategy fits")


def test_auto_is_refused_where_it_cannot_plan() -> None:
    import shardwise
    from shardwise import ConfigError

    with pytest.raises(ConfigError, match="strategy='auto' plans for the torch backend"):
        shardwise.EngineConfig.of(strategy="auto", backend="deepspeed")
    engine = shardwise.Engine(strategy="auto", cpu=True)
    with pytest.raises(ConfigError, match="pass exactly one model and its DataLoader"):
        engine.prepare(torch.nn.Linear(2, 2))


def test_planner_predicts_host_memory_to_build_and_load() -> None:
    """Built whole, every process holds the model; built empty and loaded, a zero3 process holds
    its half plus one tensor's rows (the figure benchmarks/load.py measures with VmHWM)."""
    from shardwise.plan import CANDIDATES
    from shardwise.plan.load import load_memory
    from shardwise.plan.presets import resolve_model

    cands = [c for c in CANDIDATES if not c.checkpointed]
    by = {(c.strategy, c.offload): c for c in cands}
    cpu = load_memory(resolve_model("gpt2-large", seq_len=128), cands, world_size=2, device="cpu")
    assert cpu.parameters == pytest.approx(774_030_080 * 4, rel=1e-3)  # GPT-2 Large, fp32, tied head once
    zero3 = by[("zero3", "none")]
    assert cpu.load[zero3] < 0.6 * cpu.whole and cpu.init[zero3] < 0.6 * cpu.whole
    assert cpu.load[by[("ddp", "none")]] >= cpu.whole  # replicas: the whole model on every process anyway
    gpu = load_memory(resolve_model("gpt2-large", seq_len=128), cands, world_size=2, device="cuda")
    assert gpu.load[zero3] < 0.1 * gpu.whole  # the shards go to the GPU
    # offloaded shards stay on the host
    assert gpu.load[by[("zero3", "params")]] == pytest.approx(cpu.load[zero3])
