"""Activation checkpointing modes: full, selective (torch's matmul policy, or every k-th block in
full), offload (saved activations in host memory).

Each mode trains exactly what no checkpointing trains (fp32: the recompute runs the same kernels
on the same inputs, so the runs agree to the last bit here; we allow 1e-6 on losses and weights),
at 2 processes on zero3 and on ddp and in one process, and within the equivalence suite's
tolerances of one plain PyTorch process. Memory: the bytes a forward leaves for backward are
ordered none > selective > full, and the planner's per-process peak of every mode is within its
usual 5% (`test_plan.TOLERANCE`) of a real 2-process run. Offload on a CPU run keeps everything
where it is (host memory already); what it sends to the host on a GPU is measured here as the
bytes that pass through `blocks.to_host`, against the planner's host figure for a CUDA target.
"""

from __future__ import annotations

import copy
import functools
import gc
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from test_plan import TOLERANCE, LiveStorage

from shardwise import ConfigError
from shardwise.plan import Candidate, Overheads, PlanError, PlanRequest, plan_model
from shardwise.plan.presets import hf_spec
from shardwise.strategies import apply_activation_checkpointing, find_blocks

# (mode, every): every way to checkpoint, and none (the reference)
MODES: list[tuple[str, int | None]] = [("none", None), ("full", None), ("selective", None), ("selective", 2),
                                       ("offload", None)]
SAME = 1e-6  # checkpointed vs not, same strategy and process count
RUN = {"batch": 2, "accum": 2, "steps": 3}
# a GPT-2 whose activations outweigh its parameters (sequence 128, narrow vocabulary), so that
# the modes differ by far more than the tolerance; 3 blocks, traced whole
GPT2_ACT = {"vocab_size": 96, "n_positions": 128, "n_embd": 64, "n_layer": 3, "n_head": 2,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
SEQ, BATCH = 128, 4


def _kw(mode: str, every: int | None) -> dict[str, Any]:
    return {"activation_checkpointing": mode, "activation_checkpointing_every": every}


def _name(mode: str, every: int | None) -> str:
    return f"{mode}/{every}" if every else mode


def _spec() -> Any:
    import transformers

    return hf_spec("gpt2-act", transformers.GPT2Config(**GPT2_ACT), "GPT2LMHeadModel", SEQ)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# -- the 2-process side: training equivalence and measured peaks, in one spawn -------------------
@dataclass(frozen=True, slots=True)
class Measured:
    """One mode's real step: the peak of live storage, the most bytes sent through `to_host`."""

    peak: float
    to_host: float


def _measure(strategy: str) -> dict[str, Measured]:
    """Per mode: this rank's peak of live tensor bytes over two real training steps (as in
    `test_plan._measure`), and the largest bytes one step sent through `blocks.to_host`."""
    import shardwise
    from shardwise.strategies import blocks

    spec = _spec()
    torch.manual_seed(0)
    template = spec.build(None)
    sent = {"step": 0.0, "most": 0.0}
    original = blocks.to_host

    def to_host(t: torch.Tensor, pin: bool) -> Any:
        sent["step"] += t.numel() * t.element_size()
        return original(t, pin)

    blocks.to_host = to_host  # type: ignore[assignment]
    out: dict[str, Measured] = {}
    for mode, every in MODES:
        engine = shardwise.Engine(strategy=strategy, cpu=True, **_kw(mode, every))
        model = copy.deepcopy(template)
        optimizer = _optimizer(model.parameters())
        live = LiveStorage()
        for t in list(model.parameters()) + list(model.buffers()):
            live.tensor(t)
        sent["most"] = 0.0
        with live:
            model, optimizer = engine.prepare(model, optimizer)
            live.peak = live.now
            result = None
            for _ in range(2):
                sent["step"] = 0.0
                batch = spec.make_batch(BATCH)
                result = model(**batch)
                engine.backward(result.loss)
                optimizer.step()
                optimizer.zero_grad()
                sent["most"] = max(sent["most"], sent["step"])
            del result, batch
        out[_name(mode, every)] = Measured(float(live.peak), sent["most"])
        del model, optimizer, engine
        gc.collect()
    blocks.to_host = original  # type: ignore[assignment]
    return out


@dataclass(frozen=True, slots=True)
class TwoProcess:
    """Rank 0's results: the training runs by (strategy, mode), the measured steps by strategy."""

    train: dict[tuple[str, str], W.Trained]
    measured: dict[str, dict[str, Measured]]


def _two_process_runs() -> TwoProcess:
    train = {(s, _name(m, e)): W.train_engine("gpt2", {"strategy": s, "cpu": True, **_kw(m, e)}, **RUN)
             for s in ("zero3", "ddp") for m, e in MODES}
    return TwoProcess(train, {s: _measure(s) for s in ("zero3",)})


@pytest.fixture(scope="module")
def runs() -> TwoProcess:
    return spawn(_two_process_runs, 2)[0]  # type: ignore[no-any-return]  # rank 0: full state dicts


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_every_mode_trains_what_no_checkpointing_trains_on_two_processes(runs: TwoProcess,
                                                                         strategy: str) -> None:
    ref = W.reference("gpt2", world=2, batch=RUN["batch"], accum=RUN["accum"], steps=RUN["steps"])
    plain = runs.train[(strategy, "none")]
    assert W.close(plain.losses, ref.losses) < 1e-5 and W.max_diff(plain.state, ref.state) < 2e-5
    for mode, every in MODES[1:]:
        run = runs.train[(strategy, _name(mode, every))]
        print(f"{strategy} {_name(mode, every)}: losses {W.close(run.losses, plain.losses):.1e}, "
              f"weights {W.max_diff(run.state, plain.state):.1e} from no checkpointing")
        assert W.close(run.losses, plain.losses) <= SAME, (strategy, mode, every)
        assert W.max_diff(run.state, plain.state) <= SAME, (strategy, mode, every)
        assert W.close(run.losses, ref.losses) < 1e-5 and W.max_diff(run.state, ref.state) < 2e-5


def _plan(device: str) -> Any:
    cands = [Candidate("zero3", "none", m, None, e) for m, e in MODES]
    request = PlanRequest(world_size=2, device_memory="1TB", batch=BATCH, device=device,  # type: ignore[arg-type]
                          candidates=cands, workers=2, optimizer=_optimizer,
                          overheads=Overheads(cuda_context=0, nccl_buffers=0, fragmentation=0))
    return plan_model(_spec(), request)


def test_planner_peak_of_every_mode_matches_a_real_two_process_run(runs: TwoProcess) -> None:
    """CPU target: predicted per-process peak within 5% of the measured one, for each mode; the
    measured peaks differ by far more than that (so the check tells the modes apart)."""
    measured = runs.measured["zero3"]
    plan = _plan("cpu")
    report = []
    for mode, every in MODES:
        real = measured[_name(mode, every)].peak
        predicted = plan.find("zero3", "none", mode, activation_checkpointing_every=every).peak
        report.append(f"{_name(mode, every):12s} predicted {predicted / 2**20:7.2f} MiB  measured "
                      f"{real / 2**20:7.2f} MiB  {predicted / real - 1:+.2%}")
    print("\n".join(report))
    for mode, every in MODES:
        real = measured[_name(mode, every)].peak
        predicted = plan.find("zero3", "none", mode, activation_checkpointing_every=every).peak
        assert abs(predicted / real - 1) <= TOLERANCE, "\n".join(report)
    check_peaks_ordered(measured)
    # FLOPs: full recomputes every block's forward, selective only what its policy does not keep
    flops = {_name(m, e): plan.find("zero3", "none", m, activation_checkpointing_every=e).compute_seconds
             for m, e in MODES}
    assert flops["full"] > flops["selective/2"] > flops["selective"] == flops["offload"] == flops["none"]


def check_peaks_ordered(measured: dict[str, Measured]) -> None:
    """The measured peaks of the modes differ as checkpointing says they must."""
    peak = {_name(m, e): measured[_name(m, e)].peak for m, e in MODES}
    assert peak["none"] > 1.3 * peak["selective"] > 1.3 * peak["full"], \
        f"peaks by mode {peak}: none's not above 1.3 x selective's, or selective's not above 1.3 x full's"
    # on CPU offload copies nothing (host memory already): it holds what none holds, less the KV
    # cache `transformers` keeps without checkpointing (every mode turns it off)
    assert peak["selective"] < peak["offload"] <= peak["none"], peak


def test_planner_keeps_offloaded_activations_off_the_device_for_cuda(runs: TwoProcess) -> None:
    """CUDA target: the host figure of offload is what a real run sends through `to_host` (per
    process, one step), within 5%; the device peak drops by about as much; no other mode uses
    host memory."""
    sent = runs.measured["zero3"]["offload"].to_host
    plan = _plan("cuda")
    off, none = plan.find("zero3", "none", "offload"), plan.find("zero3")
    print(f"offload to host: predicted {off.host / 2**20:.2f} MiB, real {sent / 2**20:.2f} MiB; device peak "
          f"{off.peak / 2**20:.2f} MiB vs {none.peak / 2**20:.2f} MiB without checkpointing")
    assert sent > 0 and abs(off.host / sent - 1) <= TOLERANCE, (off.host, sent)
    # the device drops by most of what went to the host (a tensor saved by two ops, or two views
    # of one storage, is copied twice but was held on the device once)
    assert none.peak - off.peak >= 0.7 * off.host, (none.peak, off.peak, off.host)
    assert off.peak < 0.5 * none.peak
    assert off.breakdown["activations"] < 0.1 * none.breakdown["activations"]
    assert all(plan.find("zero3", "none", m, activation_checkpointing_every=e).host == 0
               for m, e in MODES if m != "offload")


# -- one process ----------------------------------------------------------------------------------
ONE = {"batch": 4, "accum": 1, "steps": 2}


@functools.cache
def _plain_one_process() -> W.Trained:
    return W.train_engine("gpt2", {"cpu": True, "strategy": "zero3"}, **ONE)


@pytest.mark.parametrize("mode, every", MODES[1:])
def test_every_mode_trains_what_no_checkpointing_trains_in_one_process(mode: str, every: int | None) -> None:
    plain = _plain_one_process()
    ref = W.reference("gpt2", world=1, **ONE)
    assert W.close(plain.losses, ref.losses) < 1e-5 and W.max_diff(plain.state, ref.state) < 2e-5
    run = W.train_engine("gpt2", {"cpu": True, "strategy": "zero3", **_kw(mode, every)}, **ONE)
    print(f"one process {_name(mode, every)}: losses {W.close(run.losses, plain.losses):.1e}, "
          f"weights {W.max_diff(run.state, plain.state):.1e}")
    assert W.close(run.losses, plain.losses) <= SAME
    assert W.max_diff(run.state, plain.state) <= SAME


def _held_after_forward(mode: str, every: int | None) -> tuple[int, list[torch.Tensor]]:
    """Bytes a forward leaves alive for backward (live storage after the loss, less before), and
    the tensors offload's `to_host` was handed."""
    from shardwise.strategies import blocks

    model = _spec().build(None)
    model.config.use_cache = False  # as the engine sets it for checkpointing
    handed: list[torch.Tensor] = []
    original = blocks.to_host

    def to_host(t: torch.Tensor, pin: bool) -> Any:
        handed.append(t)
        return original(t, pin)

    if mode != "none":
        apply_activation_checkpointing(find_blocks(model), mode, every=every)
    live = LiveStorage()
    for t in list(model.parameters()) + list(model.buffers()):
        live.tensor(t)
    blocks.to_host = to_host  # type: ignore[assignment]
    try:
        with live:
            before = live.now
            loss = model(**_spec().make_batch(2)).loss
            held = live.now - before
            loss.backward()
    finally:
        blocks.to_host = original  # type: ignore[assignment]
    return held, handed


def test_saved_activations_are_ordered_and_offload_keeps_them_on_the_host() -> None:
    held = {}
    for mode, every in MODES:
        held[_name(mode, every)], handed = _held_after_forward(mode, every)
        if mode == "offload":
            assert handed and all(t.device.type == "cpu" for t in handed)
            params = {id(p) for p in _spec().build(None).parameters()}
            assert not any(id(t) in params for t in handed)
        else:
            assert handed == []
    assert held["none"] > held["selective/2"] > held["full"], held
    assert held["none"] > held["selective"] > held["full"], held
    assert held["offload"] == held["none"]  # on CPU the saved activations are host memory already


def test_modes_are_idempotent_and_bad_settings_are_refused_in_one_line() -> None:
    model = W.build("tiny")
    blocks = find_blocks(model)
    apply_activation_checkpointing(blocks, "selective", every=2)
    wrapped = [b.forward for b in blocks]
    apply_activation_checkpointing(blocks, "selective", every=2)
    assert [b.forward for b in blocks] == wrapped  # nothing wrapped twice
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in W.build("tiny").named_parameters()]
    with pytest.raises(ConfigError, match="already checkpointed as 'selective'"):
        apply_activation_checkpointing(blocks, "full")
    with pytest.raises(ConfigError, match="is not a mode; choose one of: full, selective, offload"):
        apply_activation_checkpointing(find_blocks(W.build("tiny")), "partial")
    with pytest.raises(ConfigError, match="activation_checkpointing_every=2 needs"):
        apply_activation_checkpointing(find_blocks(W.build("tiny")), "full", every=2)
    with pytest.raises(ConfigError, match="'offload' found no blocks to checkpoint; name them with wrap"):
        apply_activation_checkpointing([], "offload")
    with pytest.raises(PlanError, match="activation_checkpointing='sometimes' is not valid"):
        PlanRequest(world_size=1, device_memory="1GB", activation_checkpointing="sometimes").check()
    with pytest.raises(PlanError, match="activation_checkpointing_every=3 needs"):
        Candidate("zero3", "none", "full", None, 3)
    assert Candidate("ddp", "none", True) == Candidate("ddp", "none", "full")  # a bool reads as full
    assert Candidate("zero3", "none", "selective", None, 2).name == "zero3 + AC selective/2"


def test_cli_and_request_plan_the_mode_asked_for(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`shardwise plan --activation-checkpointing MODE` plans every strategy with that mode
    (alone: full; --no-...: none; no flag: none and full, as before); bad input: one line."""
    import dataclasses

    from shardwise import cli
    from shardwise.plan import CANDIDATES, planner

    class Traced(Exception):
        pass

    seen: list[list[Candidate]] = []

    def trace(spec: Any, cands: Any, request: Any, **kw: Any) -> Any:
        seen.append(list(cands))
        raise Traced

    monkeypatch.setattr(planner, "_trace_candidates", trace)
    plain = [c for c in CANDIDATES if not c.checkpointed]
    ac = "--activation-checkpointing"
    cases = [([], None, None), ([ac], "full", None), (["--no-activation-checkpointing"], "none", None),
             ([ac, "offload"], "offload", None), ([ac, "selective", f"{ac}-every", "2"], "selective", 2)]
    base = ["plan", "--model", "gpt2", "--gpu-memory", "24GB"]
    for flags, mode, every in cases:
        with pytest.raises(Traced):
            cli.main([*base, *flags])
        want = list(CANDIDATES) if mode is None else [
            dataclasses.replace(c, activation_checkpointing=mode, activation_checkpointing_every=every)
            for c in plain]
        assert seen[-1] == want, flags
    assert [c.name for c in seen[-1][:2]] == ["ddp + AC selective/2", "zero1 + AC selective/2"]
    capsys.readouterr()
    assert cli.main([*base, f"{ac}-every", "2"]) == 2
    err = capsys.readouterr().err
    assert "activation_checkpointing_every=2 needs activation_checkpointing='selective'" in err
    assert len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit):
        cli.main([*base, ac, "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_auto_plans_the_configured_mode() -> None:
    """`strategy="auto"` plans every strategy with the config's mode (and its `every`), and the
    chosen plan trains what one plain process trains."""
    import shardwise

    engine = shardwise.Engine(strategy="auto", cpu=True, seed=W.SEED, offload="optimizer",
                              activation_checkpointing="selective", activation_checkpointing_every=2)
    run = W.run_loop(engine, "gpt2", batch=2, steps=2)
    ref = W.reference("gpt2", world=1, batch=2, accum=1, steps=2)
    names = [p.name for p in engine.plan.plans]
    assert names and all(n.endswith(" + AC selective/2") and "offload optimizer" in n for n in names), names
    assert engine.plan.best.candidate.activation_checkpointing == "selective"
    cfg = engine.config
    assert (cfg.blocks.activation_checkpointing, cfg.blocks.activation_checkpointing_every) == (
        "selective", 2)
    assert W.close(run.losses, ref.losses) < 1e-5 and W.max_diff(run.state, ref.state) < 2e-5


def _planted_measure() -> dict[str, Measured]:
    return _measure("zero3")  # (as the real test's)


def test_a_mode_the_engine_never_applies_is_caught() -> None:
    caught(check_peaks_ordered, spawn(planted(_planted_measure, "checkpointing_not_applied"), 2)[0],
           must=r"peaks by mode \{'none': [\d.]+, 'full': ([\d.]+), 'selective': \1, ")  # full = selective
