"""Every strategy trains exactly the model one plain process trains (fp32, 2 CPU processes).

Tolerances: the reference computes each global micro-batch in one forward, the sharded runs in
two halves whose gradients are averaged, so fp32 rounding differs; torch's own DDP lands at the
same distance (~1e-6 on weights after 4 AdamW steps at lr 1e-3). We assert
losses within 1e-5, clip norms within 1e-5 relative, final weights within 2e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import workloads as W
from planted import caught, planted
from spawn import spawn

CONFIGS: list[dict[str, Any]] = [
    *W.STRATEGIES,
    {"strategy": "zero1", "offload": "optimizer"},
    {"strategy": "zero3", "activation_checkpointing": True},
    {"strategy": "ddp", "activation_checkpointing": True},
]
MODELS = ["tiny", "gpt2"]
RUN = {"batch": 2, "accum": 2, "steps": 4}


def _key(cfg: dict[str, Any]) -> str:
    return "+".join("checkpointing" if v is True else str(v) for v in cfg.values())


# The script clips once with a small bound (step 1), with and without a config bound for the
# other steps: a bound set by one clip_grad_norm_ call must last that step only.
CLIP_ONCE = {1: 0.01}
CLIP_CASES: dict[str, tuple[dict[str, Any], dict[int, float]]] = {
    "script only": ({}, {1: 0.01}),
    "config 0.5": ({"max_grad_norm": 0.5}, {0: 0.5, 1: 0.01, 2: 0.5, 3: 0.5}),
}  # case -> (engine settings, the bounds one plain process applies)


def clip_once_runs(engine_kw: dict[str, Any]) -> dict[str, W.Trained]:
    return {case: W.train_engine("tiny", {**engine_kw, **settings}, **{**RUN, "clip": CLIP_ONCE})
            for case, (settings, _) in CLIP_CASES.items()}


def check_clip_once(runs: dict[str, W.Trained]) -> None:
    """Each run equals one plain process clipping with the same bounds; a bound that leaked into
    the later steps would land far away (asserted, so this check can fail)."""
    for case, (_, bounds) in CLIP_CASES.items():
        ref = W.reference("tiny", world=2, **{**RUN, "clip": bounds})
        leaked_bounds = {**({0: bounds[0]} if 0 in bounds else {}), 1: 0.01, 2: 0.01, 3: 0.01}
        leaked = W.reference("tiny", world=2, **{**RUN, "clip": leaked_bounds})
        assert W.max_diff(leaked.state, ref.state) > 1e-4, case
        run = runs[case]
        assert W.close(run.losses, ref.losses) < 1e-5, \
            f"{case}: losses {W.close(run.losses, ref.losses):.2e} from one process clipping with the " \
            "same bounds"
        assert W.close(run.norms, [ref.norms[list(bounds).index(1)]]) < 1e-5 * max(ref.norms), case
        assert W.max_diff(run.state, ref.state) < 2e-5, case


def _train_all() -> dict[tuple[str, str], W.Trained | dict[str, W.Trained]]:
    out: dict[tuple[str, str], W.Trained | dict[str, W.Trained]] = {
        (name, _key(cfg)): W.train_engine(name, {"cpu": True, **cfg}, **RUN)
        for name in MODELS
        for cfg in CONFIGS
    }
    for strategy in ("zero3", "zero1"):
        out[("clip once", strategy)] = clip_once_runs({"cpu": True, "strategy": strategy})
    return out


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], W.Trained | dict[str, W.Trained]]:
    return spawn(_train_all, 2)[0]  # rank 0 holds the full state dicts


@pytest.fixture(scope="module")
def refs() -> dict[str, W.Trained]:
    return {name: W.reference(name, world=2, **RUN) for name in MODELS}


@pytest.mark.parametrize("cfg", CONFIGS, ids=_key)
@pytest.mark.parametrize("name", MODELS)
def test_matches_single_process(runs: dict, refs: dict, name: str, cfg: dict[str, str]) -> None:
    check_matches(runs[(name, _key(cfg))], refs[name], name)


def check_matches(run: W.Trained, ref: W.Trained, name: str) -> None:
    W.check_matches(run, ref, name, name)


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_a_clip_bound_lasts_one_step(runs: dict, strategy: str) -> None:
    check_clip_once(runs[("clip once", strategy)])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c["strategy"] in ("zero2", "zero3")], ids=_key)
def test_zero23_memory_is_half_of_ddp(runs: dict, name: str, cfg: dict[str, str]) -> None:
    check_half_of_ddp(runs[(name, "ddp")].memory, runs[(name, _key(cfg))].memory, cfg)


def check_half_of_ddp(ddp: Any, sharded: Any, cfg: dict[str, str]) -> None:
    assert sharded.params == pytest.approx(ddp.params / 2, rel=0.05), \
        f"{cfg}: parameters held per process {sharded.params}, ddp's {ddp.params}: not half"
    assert sharded.grads == pytest.approx(ddp.grads / 2, rel=0.05)
    if cfg.get("offload", "none") == "none" or cfg.get("offload") == "params":
        assert sharded.optimizer == pytest.approx(ddp.optimizer / 2, rel=0.05)


@pytest.mark.parametrize("name", MODELS)
def test_zero1_shards_only_optimizer_state(runs: dict, name: str) -> None:
    ddp, z1 = runs[(name, "ddp")].memory, runs[(name, "zero1")].memory
    assert z1.params == ddp.params and z1.grads == ddp.grads
    assert z1.optimizer == pytest.approx(ddp.optimizer / 2, rel=0.05)


def _gloo_reduce_scatter() -> dict[str, Any]:
    """FSDP2's gradient reduce-scatter on gloo (ours: an in-place all-reduce and a slice) against
    gloo's own reduce-scatter, on the 4-process group and a 2-process subgroup; then which
    collectives one zero3 training step really calls."""
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.strategies.fsdp import _AllReduceScatter

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)  # joins the gloo group
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # every process makes it; ranks 0 and 1 use it
    out: dict[str, Any] = {}
    for name, group in (("world", dist.group.WORLD), ("pair", pair)):
        if rank >= dist.get_world_size(group):
            continue
        size = dist.get_world_size(group)
        torch.manual_seed(100 + rank)
        grads = torch.randn(size * 1001)
        for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            ours, gloo = torch.empty(1001), torch.empty(1001)
            buf = grads.clone()
            _AllReduceScatter()(ours, buf, group, op)
            if op == dist.ReduceOp.AVG:  # gloo's reduce-scatter has no AVG: its sum, divided
                dist.reduce_scatter_single(gloo, grads.clone(), op=dist.ReduceOp.SUM, group=group)
                gloo /= size
            else:
                dist.reduce_scatter_single(gloo, grads.clone(), op=op, group=group)
            out[f"{name} {op}"] = (ours - gloo).abs().max().item() / gloo.abs().max().item()
    calls = {"reduce_scatter": 0, "all_reduce": 0}
    originals = {k: getattr(dist, f) for k, f in (("reduce_scatter", "reduce_scatter_single"),
                                                  ("all_reduce", "all_reduce"))}

    def counting(kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[kind] += 1
            return originals[kind](*args, **kwargs)
        return call

    model = W.build("tiny")
    model, opt = engine.prepare(model, W.make_optimizer(model))
    dist.reduce_scatter_single, dist.all_reduce = counting("reduce_scatter"), counting("all_reduce")
    try:
        engine.backward(W.lm_loss(model, torch.randint(0, W.VOCAB, (2, W.SEQ))))
        opt.step()
    finally:
        dist.reduce_scatter_single, dist.all_reduce = originals["reduce_scatter"], originals["all_reduce"]
    out["calls"] = calls
    out["units"] = sum(1 for m in model.modules() if hasattr(m, "set_custom_reduce_scatter"))
    return out


def test_fsdp_reduce_scatter_on_gloo_is_an_all_reduce_and_matches_gloos() -> None:
    """gloo's reduce-scatter takes ~2x an all-reduce of the same buffer (and copies its input), so
    FSDP2 units on gloo all-reduce in place and slice. Same numbers as gloo's own reduce-scatter:
    bit for bit on 2 processes (a + b either way), within fp32 rounding of the order on 4."""
    results = spawn(_gloo_reduce_scatter, 4)
    for rank, res in enumerate(results):
        for key, diff in res.items():
            if key.startswith("pair"):
                assert diff == 0.0, (rank, key, diff)
            elif key.startswith("world"):
                assert diff < 1e-6, (rank, key, diff)
        assert sum(k.startswith("world") for k in res) == 3
        assert res["calls"]["reduce_scatter"] == 0, res["calls"]  # no gloo reduce-scatter ran
        assert res["calls"]["all_reduce"] >= res["units"] > 1, res
    assert sum(k.startswith("pair") for k in results[0]) == 3


def _planted_pair() -> dict[str, W.Trained]:
    """ddp and zero3 on the tiny model, as the real test runs them."""
    return {s: W.train_engine("tiny", {"cpu": True, "strategy": s}, **RUN) for s in ("ddp", "zero3")}


def test_gradients_left_undivided_under_accumulation_are_caught() -> None:
    run = spawn(planted(_planted_pair, "accumulation_undivided"), 2)[0]["zero3"]
    caught(check_matches, run, W.reference("tiny", world=2, **RUN), "tiny",
           must=r"^tiny: clipped norms [\d.]+e[-+]\d+ from one process's")


def test_a_zero3_that_shards_nothing_is_caught() -> None:
    runs = spawn(planted(_planted_pair, "fsdp_shards_nothing"), 2)[0]
    caught(check_half_of_ddp, runs["ddp"].memory, runs["zero3"].memory, {"strategy": "zero3"},
           must=r"^\{'strategy': 'zero3'\}: parameters held per process (\d+), ddp's \1: not half")


def _planted_clip_once() -> dict[str, W.Trained]:
    return clip_once_runs({"cpu": True, "strategy": "zero3"})  # (as the real test's zero3 case)


def test_a_clip_bound_that_outlives_its_step_is_caught() -> None:
    caught(check_clip_once, spawn(planted(_planted_clip_once, "clip_flag_sticky"), 2)[0],
           must=r"^config 0\.5: losses [\d.]+e[-+]\d+ from one process clipping with the same bounds")
