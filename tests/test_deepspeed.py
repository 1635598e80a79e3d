"""backend="deepspeed": the same loop trains the same model as one plain process and as the
torch engine; multi-model, optimizer after prepare, full weights under ZeRO-3, checkpoints that
move between engines; and the errors (no deepspeed, ddp, fp16 on CPU).

Tolerances are the equivalence tests' (losses 1e-5, clip norms 1e-5 relative, weights 2e-5;
a correct run lands near 6e-6 on weights with torch AdamW). bf16 on both engines is compared
with 2e-2 on losses: both autocast with fp32 weights, but the engines reduce in different
orders, so bf16 rounding differs a little from the first step on.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_big_models as BM
import test_checkpoint as CK
import test_data_safety as DS
import test_equivalence as EQ
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed not installed (pip install 'shardwise[deepspeed]'); CI installs it",
)

CONFIGS: list[dict[str, str]] = [c for c in W.STRATEGIES if c["strategy"] != "ddp"]
LOAD_CONFIGS = [{"strategy": "zero1"}, {"strategy": "zero3"}, {"strategy": "zero2", "offload": "optimizer"},
                {"strategy": "zero3", "offload": "params"}]
MODELS = ["tiny", "gpt2"]
CLIP = 0.5  # below every reference norm (asserted), so clipping changes every step
RUN = {"batch": 2, "accum": 2, "steps": 4, "clip": CLIP}


def _key(cfg: dict[str, Any]) -> str:
    return "+".join(str(v) for v in cfg.values())


@dataclass(frozen=True, slots=True)
class TwoModels:
    """Two models' final full weights; the optimizers' classes as the engine holds them (None: the
    plain reference)."""

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    types: list[str] | None = None


def _two_models(backend: str, strategy: str) -> TwoModels:
    """Two models, each its own optimizer; the second optimizer is made after prepare."""
    import shardwise

    engine = shardwise.Engine(backend=backend, strategy=strategy, cpu=True, seed=W.SEED)
    a, b = W.build("tiny"), W.build("tiny")
    torch.manual_seed(5)
    for p in b.parameters():  # a different model, not a copy of the first
        p.data.normal_(0, 0.05)
    opt_a = W.make_optimizer(a)
    a, opt_a = engine.prepare(a, opt_a)
    b = engine.prepare(b)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    opt_b = engine.prepare(opt_b)
    data = W.Tokens(8 * engine.num_processes).data
    mine = data.view(4, engine.num_processes, 2, -1)[:, engine.process_index]
    for ids in mine:
        for model, opt in ((a, opt_a), (b, opt_b)):
            loss = W.lm_loss(model, ids)
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
    return TwoModels(engine.get_state_dict(a), engine.get_state_dict(b),
                     [type(opt_a.optimizer).__name__, type(opt_b.optimizer).__name__])


def _two_models_reference(world: int) -> TwoModels:
    a, b = W.build("tiny"), W.build("tiny")
    torch.manual_seed(5)
    for p in b.parameters():
        p.data.normal_(0, 0.05)
    opt_a, opt_b = W.make_optimizer(a), torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    data = W.Tokens(8 * world).data.view(4, world * 2, -1)
    for ids in data:
        for model, opt in ((a, opt_a), (b, opt_b)):
            W.lm_loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
    return TwoModels(a.state_dict(), b.state_dict())


@dataclass(frozen=True, slots=True)
class Saved:
    """A ZeRO-3 model saved with save_model: its gathered weights, and this process's parameter
    shapes."""

    state: dict[str, torch.Tensor]
    local_shapes: list[tuple[int, ...]]


def _save_model_zero3(folder: str) -> Saved:
    import shardwise

    engine = shardwise.Engine(backend="deepspeed", strategy="zero3", cpu=True, seed=W.SEED)
    model, _ = W.one_step(engine, "gpt2")
    engine.save_model(model, folder)
    local = [tuple(p.shape) for p in engine.unwrap_model(model).parameters()]
    return Saved(engine.get_state_dict(model), local)


def _engine(spec: str) -> Any:
    """'deepspeed:zero2+optimizer' or 'torch:zero3' -> an Engine."""
    import shardwise

    backend, _, strategy = spec.partition(":")
    kind, _, offload = strategy.partition("+")
    return shardwise.Engine(backend=backend, strategy=kind, offload=offload or "none", cpu=True, seed=W.SEED)


CROSS = [
    ("torch:zero3", "deepspeed:zero2"),
    ("torch:zero2", "deepspeed:zero3+optimizer"),
    ("deepspeed:zero3", "torch:zero3"),
    ("deepspeed:zero1", "torch:zero2+optimizer"),
    ("deepspeed:zero2+optimizer", "deepspeed:zero3+params"),
]


# host_kernel="deepspeed": DeepSpeed's CPUAdam steps every host step, on either backend
KERNEL_CONFIGS: list[dict[str, str]] = [
    {"backend": "torch", "strategy": "zero2", "offload": "optimizer"},
    {"backend": "torch", "strategy": "zero3", "offload": "params"},
    {"backend": "torch", "strategy": "zero1"},  # a CPU device's step is a host step too
    {"backend": "torch", "strategy": "ddp"},
    {"backend": "deepspeed", "strategy": "zero2", "offload": "optimizer"},
    {"backend": "deepspeed", "strategy": "zero3", "offload": "params"},
]


def _kernel_runs(configs: list[dict[str, str]] = KERNEL_CONFIGS) -> dict[str, tuple[W.Trained, int]]:
    """Each of `configs`' runs, with the number of elements DeepSpeed's kernel stepped in it."""
    from shardwise.strategies.host_step import DeepSpeedAdam

    calls = []
    step = DeepSpeedAdam.step

    def counted(self: DeepSpeedAdam, optimizer: torch.optim.Optimizer) -> None:
        calls.append(sum(getattr(p, "_local_tensor", p).numel() for g in optimizer.param_groups
                         for p in g["params"] if p.grad is not None))
        step(self, optimizer)

    DeepSpeedAdam.step = counted  # type: ignore[method-assign]
    try:
        out = {}
        for cfg in configs:
            before = len(calls)
            run = W.train_engine("gpt2", {"cpu": True, "host_kernel": "deepspeed", **cfg}, **RUN)
            out[_key(cfg)] = (run, sum(calls[before:]))  # and the elements the kernel stepped
    finally:
        DeepSpeedAdam.step = step  # type: ignore[method-assign]
    return out


def _config_clip() -> W.Trained:
    return W.train_engine(
        "tiny", {"cpu": True, "backend": "deepspeed", "strategy": "zero2", "max_grad_norm": CLIP},
        batch=2, accum=2, steps=4, clip=None,  # the script never clips; the config's bound applies
    )


def _everything(folder: str) -> dict[str, Any]:
    """All DeepSpeed runs of this file in one pair of processes (DeepSpeed starts slowly)."""
    out: dict[str, Any] = {}
    for name in MODELS:
        for cfg in CONFIGS:
            out[("eq", name, _key(cfg))] = W.train_engine(
                name, {"cpu": True, "backend": "deepspeed", **cfg}, **RUN)
    for backend in ("torch", "deepspeed"):
        for precision in ("fp32", "bf16"):
            kw = {"cpu": True, "backend": backend, "strategy": "zero3", "precision": precision}
            out[("engines", backend, precision)] = W.train_engine(
                "tiny", kw, batch=2, accum=2, steps=2, clip=CLIP)
    out["config_clip"] = _config_clip()
    for strategy in ("zero2", "zero3"):
        out[("clip once", strategy)] = EQ.clip_once_runs(
            {"cpu": True, "backend": "deepspeed", "strategy": strategy})
    out["kernel"] = _kernel_runs()
    out["two_models"] = _two_models("deepspeed", "zero3")
    out["save_model"] = _save_model_zero3(f"{folder}/export")
    saved = {src: CK._train(_engine(src), 4, save=f"{folder}/{src}") for src, _ in CROSS}
    out["cross"] = {(s, d): (saved[s].losses, CK._train(_engine(d), 4, load=f"{folder}/{s}"))
                    for s, d in CROSS}
    out["load"] = BM.load_runs("deepspeed", LOAD_CONFIGS, f"{folder}/gpt2-pretrained")
    out["careless"] = DS.careless_user("deepspeed", f"{folder}/careless")  # last: it changes directory
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("ds")
    BM.save_pretrained_gpt2(folder)
    both = spawn(_everything, 2, str(folder), timeout=1200)  # a fresh machine first builds two DeepSpeed ops
    out = both[0]
    out["careless"] = [rank["careless"] for rank in both]
    out["folder"] = folder
    return out


@pytest.fixture(scope="module")
def refs() -> dict[str, W.Trained]:
    return {name: W.reference(name, world=2, **RUN) for name in MODELS}


@pytest.mark.parametrize("cfg", KERNEL_CONFIGS, ids=_key)
def test_deepspeed_host_kernel_matches_single_process(runs: dict, refs: dict, cfg: dict[str, str]) -> None:
    """host_kernel="deepspeed" trains the plain process's model on both backends, and it is
    DeepSpeed's kernel that stepped: over the 4 steps at least 4 x this process's half of the
    model's elements (all of them under ddp), counted as they pass through its kernel."""
    check_kernel(runs["kernel"][_key(cfg)], refs["gpt2"], cfg)


def check_kernel(result: tuple[W.Trained, int], ref: W.Trained, cfg: dict[str, str]) -> None:
    run, kernel_elements = result
    numel = sum(p.numel() for p in W.build("gpt2").parameters())
    share = numel if cfg["strategy"] == "ddp" else numel // 2
    assert kernel_elements >= 4 * share, \
        f"the host kernel stepped {kernel_elements} elements, not at least 4 x the share of {share}"
    assert W.close(run.losses, ref.losses) < 1e-5
    assert W.close(run.norms, ref.norms) < 1e-5 * max(ref.norms)
    assert W.max_diff(run.state, ref.state) < 2e-5
    assert W.max_diff(run.state, W.build("gpt2").state_dict()) > 1e-3


@pytest.mark.parametrize("cfg", CONFIGS, ids=_key)
@pytest.mark.parametrize("name", MODELS)
def test_deepspeed_matches_single_process(runs: dict, refs: dict, name: str, cfg: dict[str, str]) -> None:
    check_matches(runs[("eq", name, _key(cfg))], refs[name], name)


def check_matches(run: W.Trained, ref: W.Trained, name: str) -> None:
    assert min(ref.norms) > CLIP  # so the clip really acts on every step
    W.check_matches(run, ref, name, name)


def test_clipping_really_clips(runs: dict, refs: dict) -> None:
    """Without the clip the weights land far from the clipped reference: the clip is applied."""
    unclipped = W.reference("tiny", world=2, batch=2, accum=2, steps=4, clip=1e9)
    assert W.max_diff(unclipped.state, refs["tiny"].state) > 5e-5  # (measured 1.2e-4; clipped: within 2e-5)
    check_config_clip(runs["config_clip"], refs["tiny"])


def check_config_clip(run: W.Trained, ref: W.Trained) -> None:
    """The config's max_grad_norm is applied by DeepSpeed's step, with no clip call in the loop."""
    assert W.max_diff(run.state, ref.state) < 2e-5, \
        f"weights {W.max_diff(run.state, ref.state):.2e} from one process clipping at the config's " \
        "max_grad_norm"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_and_deepspeed_engines_agree(runs: dict, precision: str) -> None:
    torch_run, ds_run = runs[("engines", "torch", precision)], runs[("engines", "deepspeed", precision)]
    check_engines_agree(torch_run, ds_run, precision)
    if precision == "bf16":  # bf16 really computed in bf16: it differs from fp32
        assert W.close(runs[("engines", "deepspeed", "fp32")].losses, ds_run.losses) > 1e-6


def check_engines_agree(torch_run: W.Trained, ds_run: W.Trained, precision: str) -> None:
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert W.is_finite(ds_run.losses) and len(ds_run.losses) == 4
    assert W.close(torch_run.losses, ds_run.losses) < tol, \
        f"{precision}: losses {W.close(torch_run.losses, ds_run.losses):.2e} apart on the two engines"
    assert W.close(torch_run.norms, ds_run.norms) < tol * max(torch_run.norms), \
        f"{precision}: clipped norms {W.close(torch_run.norms, ds_run.norms):.2e} apart on the two engines " \
        f"(torch {torch_run.norms}, DeepSpeed {ds_run.norms})"


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_clip_bound_lasts_one_step(runs: dict, strategy: str) -> None:
    EQ.check_clip_once(runs[("clip once", strategy)])


def test_two_models_each_with_its_optimizer(runs: dict) -> None:
    check_two_models(runs["two_models"])


def test_optimizer_state_started_afresh_at_each_step_is_caught() -> None:
    """`deepspeed_optimizer_state_fresh`: SGD's momentum and AdamW's moments lost at every step;
    both models' weights leave the reference's."""
    caught(check_two_models, spawn(planted(_two_models, "deepspeed_optimizer_state_fresh"), 2, "deepspeed",
                                   "zero3", timeout=1200)[0],
           must=r"^model a \(AdamW\): weights [\d.]+e[-+]\d+ from one process's")


def check_two_models(run: TwoModels) -> None:
    ref = _two_models_reference(2)
    assert run.types == ["AdamW", "SGD"]  # the user's classes, never swapped
    assert W.max_diff(run.a, ref.a) < 2e-5, \
        f"model a ({run.types[0]}): weights {W.max_diff(run.a, ref.a):.2e} from one process's"
    assert W.max_diff(run.b, ref.b) < 2e-5, \
        f"model b ({run.types[1]}): weights {W.max_diff(run.b, ref.b):.2e} from one process's"


def test_zero3_full_weights_and_save_model(runs: dict) -> None:
    check_saved_zero3(runs["save_model"], runs["folder"] / "export")


def check_saved_zero3(out: Saved, folder: Path) -> None:
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    full = W.build("gpt2").state_dict()
    assert set(out.state) == set(full)
    assert all(out.state[k].shape == full[k].shape for k in full)
    assert all(s == (0,) for s in out.local_shapes)  # ZeRO-3 really partitioned them
    saved = load_file(folder / "model.safetensors")
    for k, v in saved.items():
        assert torch.equal(v, out.state[k]), f"{k}: saved unlike the gathered weights"
    model = GPT2LMHeadModel.from_pretrained(folder)
    assert W.max_diff(model.state_dict(), out.state) == 0.0


def test_pretrained_weights_load_on_deepspeed(runs: dict) -> None:
    BM.check_load_runs(runs["load"], runs["folder"] / "gpt2-pretrained", LOAD_CONFIGS)


@pytest.mark.parametrize("scenario", list(DS.CARELESS))
def test_careless_user_loses_nothing_on_deepspeed(runs: dict, scenario: str) -> None:
    DS.CARELESS[scenario](runs["careless"], runs["folder"] / "careless")


@pytest.mark.parametrize("pair", CROSS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_checkpoint_moves_between_engines(runs: dict, pair: tuple[str, str]) -> None:
    check_moved(*runs["cross"][pair])


def check_moved(first: list[float], run: W.Checkpointed) -> None:
    ref = CK._reference(8)
    assert W.close(first + run.losses, ref.losses) < 1e-5, \
        f"losses across the resume {W.close(first + run.losses, ref.losses):.2e} from one process's"
    assert W.max_diff(run.state, ref.state) < 2e-5
    assert run.step == 8 and run.lr == pytest.approx([1e-3 * 0.9**8] * 2)  # both groups


# -- refused before any work ----------------------------------------------------------------------
def test_deepspeed_config_translation() -> None:
    from shardwise import EngineConfig
    from shardwise.strategies.deepspeed.strategy import deepspeed_config

    cpu = torch.device("cpu")
    ds = deepspeed_config(EngineConfig.of(backend="deepspeed", strategy="zero3", offload="params",
                                       precision="bf16", max_grad_norm=1.0), device=cpu, numel=1000)
    zero = ds["zero_optimization"]
    assert (zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
            and zero["offload_optimizer"]["device"] == "cpu")
    assert zero["reduce_bucket_size"] == 1000 and zero["stage3_param_persistence_threshold"] == 0
    assert zero["stage3_max_reuse_distance"] == 0  # resharded after forward, as FSDP2's zero3
    assert ds["gradient_clipping"] == 1.0 and ds["gradient_accumulation_steps"] == 1
    assert ds["torch_autocast"]["dtype"] == "bfloat16" and "bf16" not in ds
    assert ds["zero_force_ds_cpu_optimizer"] is False
    z1 = deepspeed_config(EngineConfig.of(backend="deepspeed", strategy="zero1"), device=cpu,
                          numel=10**9)
    assert z1["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 2**24,
                                       "allgather_bucket_size": 2**24}


def test_deepspeed_json_tuning_keys_pass_through(tmp_path: Path) -> None:
    import json

    from shardwise import EngineConfig
    from shardwise.strategies.deepspeed.strategy import deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True,
                                                      "sub_group_size": "auto",
                                                      "stage3_max_live_parameters": 1e8}}))
    cfg = EngineConfig.of(backend="deepspeed", strategy="zero2", deepspeed_config=str(path))
    zero = deepspeed_config(cfg, device=torch.device("cpu"), numel=10)["zero_optimization"]
    assert zero["stage"] == 2  # our strategy wins
    assert zero["overlap_comm"] is True and zero["stage3_max_live_parameters"] == 1e8
    assert "sub_group_size" not in zero  # "auto" is left to DeepSpeed
    # the JSON's tuning keys win over our zero3 defaults (DeepSpeed's own reuse distance, say)
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "stage3_max_reuse_distance": 1e9,
                                                      "stage3_param_persistence_threshold": 1e5,
                                                      "reduce_bucket_size": 123}}))
    cfg = EngineConfig.of(backend="deepspeed", strategy="zero3", deepspeed_config=str(path))
    zero = deepspeed_config(cfg, device=torch.device("cpu"), numel=10**6)["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_max_reuse_distance"] == 1e9
    assert zero["stage3_param_persistence_threshold"] == 1e5 and zero["reduce_bucket_size"] == 123
    assert zero["allgather_bucket_size"] == 10**6  # ours where the JSON is silent


def test_bad_deepspeed_combinations_are_refused() -> None:
    import shardwise
    from shardwise import ConfigError

    with pytest.raises(ConfigError, match=r"strategy='ddp' is not run by backend='deepspeed'"
                                          r".*zero1, zero2 or zero3"):
        shardwise.Engine(backend="deepspeed", strategy="ddp", cpu=True)
    with pytest.raises(ConfigError, match=r"fp16.*needs CUDA.*bf16"):
        shardwise.Engine(backend="deepspeed", strategy="zero2", precision="fp16", cpu=True)


def test_without_deepspeed_one_clear_error(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import shardwise\n"
        "try:\n"
        "    shardwise.Engine(backend='deepspeed', strategy='zero2', cpu=True)\n"
        "except shardwise.ConfigError as e:\n"
        "    print('ERR', e)\n"
        "import torch.nn as nn; e = shardwise.Engine(strategy='zero2', cpu=True)\n"  # torch still works
        "print('OK', e.prepare(nn.Linear(2, 2)).__class__.__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERR backend='deepspeed' needs DeepSpeed" in proc.stdout
    assert "pip install 'shardwise[deepspeed]'" in proc.stdout
    assert "OK FSDPLinear" in proc.stdout  # zero2 on the torch engine


def test_deepspeed_host_kernel_is_adam_in_torch_state() -> None:
    """DeepSpeedAdam steps a torch AdamW/Adam as torch does (two groups, weight decay decoupled
    or L2, a scheduler), keeps torch's state layout (torch's kernel can take over from it), runs
    the optimizer's step hooks, and refuses what it cannot do in one line."""
    from shardwise.strategies.host_step import DeepSpeedAdam, host_kernel

    for cls, wd in ((torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.05)):
        torch.manual_seed(0)
        params = [torch.randn(64, 32), torch.randn(32)]
        mine = [p.clone().requires_grad_() for p in params]
        theirs = [p.clone().requires_grad_() for p in params]

        def make(ps: list[torch.Tensor], cls: Any = cls, wd: float = wd) -> torch.optim.Optimizer:
            return cls([{"params": [ps[0]], "weight_decay": wd}, {"params": [ps[1]], "lr": 3e-3}], lr=1e-2)

        opt, ref = make(mine), make(theirs)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref, 2, gamma=0.5)
        kernel = DeepSpeedAdam.for_optimizer(opt)
        assert kernel is not None
        seen: list[str] = []
        opt.register_step_pre_hook(lambda o, a, k, seen=seen: seen.append("pre"))
        opt.register_step_post_hook(lambda o, a, k, seen=seen: seen.append("post"))
        for i in range(6):
            grads = [torch.randn_like(p) for p in params]
            for p, q, g in zip(mine, theirs, grads, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            if i == 3:  # torch's kernel takes over for one step from the state the kernel wrote
                opt.step()
            else:
                kernel.step(opt)
            ref.step()
            sched.step()
            ref_sched.step()
        assert seen == ["pre", "post"] * 6 and kernel.steps == 5
        for p, q, p0 in zip(mine, theirs, params, strict=True):
            assert (p - q).abs().max().item() < 1e-5 and (p - p0).abs().max().item() > 1e-3
        st, rst = opt.state[mine[0]], ref.state[theirs[0]]
        assert sorted(st) == sorted(rst) and st["step"].dtype == rst["step"].dtype and float(st["step"]) == 6
        assert (st["exp_avg_sq"] - rst["exp_avg_sq"]).abs().max().item() < 1e-6

    with pytest.raises(ValueError, match="steps Adam and AdamW only, and the optimizer is SGD: "
                                         "use host_kernel='torch'"):
        DeepSpeedAdam.for_optimizer(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))
    with pytest.raises(ValueError, match=r"cannot step AdamW\(amsgrad=True\)"):
        DeepSpeedAdam.for_optimizer(torch.optim.AdamW([torch.zeros(2, requires_grad=True)], amsgrad=True))
    with pytest.raises(ValueError, match="this run steps on cuda with offload='none': "
                                         "set offload, or host_kernel='torch'"):
        host_kernel(torch.optim.AdamW([torch.zeros(2, requires_grad=True)]), "deepspeed", on_host=False,
                    device=torch.device("cuda"))
    from shardwise.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="host_kernel"):
        EngineConfig.of(host_kernel="cuda")  # type: ignore[arg-type]


def _planted_zero2() -> W.Trained:
    return W.train_engine("tiny", {"cpu": True, "backend": "deepspeed", "strategy": "zero2"}, **RUN)


def test_a_clip_bound_never_handed_to_deepspeed_is_caught(refs: dict) -> None:
    """The script's clip_grad_norm_ returns the right norm, and DeepSpeed's step never clips."""
    run = spawn(planted(_planted_zero2, "deepspeed_clip_unset"), 2, timeout=1200)[0]
    caught(check_matches, run, refs["tiny"], "tiny",
           must=r"^tiny: (losses|weights) [\d.]+e[-+]\d+ from one process's")  # (norms: the script's, right)


def _engines_fp32() -> list[W.Trained]:
    return [W.train_engine("tiny", {"cpu": True, "backend": backend, "strategy": "zero3"},
                           batch=2, accum=2, steps=2, clip=CLIP) for backend in ("torch", "deepspeed")]


def test_a_deepspeed_loss_left_undivided_is_caught() -> None:
    """`deepspeed_loss_undivided`: the DeepSpeed engine's gradients twice the torch engine's on the
    same config; the engines' check (the fp32 pair) fails on the clipped norms."""
    on_torch, on_deepspeed = spawn(planted(_engines_fp32, "deepspeed_loss_undivided"), 2, timeout=1200)[0]
    caught(check_engines_agree, on_torch, on_deepspeed, "fp32",
           must=r"^fp32: clipped norms [\d.]+e[-+]\d+ apart on the two engines")


def test_a_config_bound_never_handed_to_deepspeed_is_caught(refs: dict) -> None:
    run = spawn(planted(_config_clip, "deepspeed_config_unclipped"), 2, timeout=1200)[0]
    caught(check_config_clip, run, refs["tiny"],
           must=r"^weights [\d.]+e[-+]\d+ from one process clipping at the config's max_grad_norm")


def test_a_zero3_save_model_rounded_on_the_way_is_caught(tmp_path: Path) -> None:
    out = spawn(planted(_save_model_zero3, "deepspeed_export_rounded"), 2, str(tmp_path), timeout=1200)[0]
    caught(check_saved_zero3, out, tmp_path, must=r"^\S+: saved unlike the gathered weights")


def _planted_cross(folder: str) -> tuple[list[float], W.Checkpointed]:
    src, dst = CROSS[0]  # torch zero3 -> deepspeed zero2 (as the real test's first pair)
    saved = CK._train(_engine(src), 4, save=f"{folder}/{src}")
    return saved.losses, CK._train(_engine(dst), 4, load=f"{folder}/{src}")


def test_a_deepspeed_load_that_drops_the_optimizer_state_is_caught(tmp_path: Path) -> None:
    worker = planted(_planted_cross, "deepspeed_optimizer_dropped")
    first, run = spawn(worker, 2, str(tmp_path), timeout=1200)[0]
    caught(check_moved, first, run, must=r"^losses across the resume [\d.]+e[-+]\d+ from one process's")


def test_a_host_kernel_setting_ignored_is_caught(refs: dict) -> None:
    cfg = KERNEL_CONFIGS[0]  # torch zero2 + optimizer offload
    runs = spawn(planted(_kernel_runs, "host_kernel_ignored"), 2, [cfg], timeout=1200)[0]
    caught(check_kernel, runs[_key(cfg)], refs["gpt2"], cfg, must=r"^the host kernel stepped 0 elements")
