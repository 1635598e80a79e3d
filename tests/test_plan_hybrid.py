"""`shardwise plan --nodes N --gpus-per-node G`: full vs hybrid sharding per rank, and the bytes
each rank sends within a node and across nodes (`shardwise.plan.comm`).

The communication formula is checked by hand here and against real processes in
tests/test_benchmarks.py (benchmarks/comm.py measures the same figures by wrapping c10d); the
hybrid plan's per-rank peak against a real 4-process hybrid run (2 groups of 2).
"""

from __future__ import annotations

import copy
import gc
import time
from typing import Any

import pytest
import torch
from spawn import spawn
from test_plan import MODELS, TOLERANCE, LiveStorage, _optimizer, _spec

from shardwise import cli
from shardwise.cli.plan import world_layout
from shardwise.config import ConfigError
from shardwise.plan import Candidate, PlanRequest, plan_model
from shardwise.plan.comm import BOUNDARY_BYTES, ring_bytes, step_comm
from shardwise.plan.presets import PlanError
from shardwise.plan.report import describe

P = 1_000_000  # parameters
MB = 4 * P  # their bytes in fp32


def flags(world: int) -> float:
    """What one rank sends for the step boundary's agreement (an all-reduce of 16 bytes)."""
    return ring_bytes("all_reduce", BOUNDARY_BYTES, world)


def test_ring_bytes() -> None:
    assert ring_bytes("all_gather", 800, 4) == ring_bytes("reduce_scatter", 800, 4) == 600
    assert ring_bytes("all_reduce", 800, 4) == 1200
    assert ring_bytes("all_reduce", 800, 1) == 0.0


@pytest.mark.parametrize(("strategy", "gathers"), [("zero3", 2), ("zero2", 1)])
def test_full_sharding_sends_everything_across_nodes(strategy: str, gathers: int) -> None:
    """2 nodes x 4: one group of 8 spans both nodes, so every byte crosses them."""
    v = step_comm(strategy, P, "fp32", world_size=8, nodes=2)
    assert v.intra == {}
    assert v.inter == {"all_gather": gathers * 7 / 8 * MB, "reduce_scatter": 7 / 8 * MB,
                       "all_reduce": flags(8)}
    one_node = step_comm(strategy, P, "fp32", world_size=8, nodes=1)
    assert one_node.inter == {} and one_node.intra == v.inter


@pytest.mark.parametrize(("strategy", "gathers"), [("zero3", 2), ("zero2", 1)])
def test_hybrid_keeps_gathers_in_the_node_and_all_reduces_a_shard_across(strategy: str, gathers: int) -> None:
    """Groups of 4 within each node: gathers and reduce-scatters stay inside; across the 2 nodes
    only the all-reduce of each rank's 1/4 gradient shard, 2(R-1)/R of it with R = 2."""
    v = step_comm(strategy, P, "fp32", world_size=8, nodes=2, group_size=4)
    assert v.intra == {"all_gather": gathers * 3 / 4 * MB, "reduce_scatter": 3 / 4 * MB}
    assert v.inter == {"all_reduce": 2 * (1 / 2) * MB / 4 + flags(8)}
    full = step_comm(strategy, P, "fp32", world_size=8, nodes=2)
    assert v.inter_bytes < full.inter_bytes / 6  # 0.25 MB against (gathers + 1) * 3.5 MB
    # the faster plan depends on the links: hybrid when the network is the slow one
    assert v.seconds(25e9, 1e9) < full.seconds(25e9, 1e9)


def test_precision_and_replicated_strategies() -> None:
    """bf16 gathers 2-byte parameters and reduces fp32 gradients; zero1 all-reduces whole fp32
    gradients over all processes and all-gathers the updated slices in its group; ddp only
    all-reduces."""
    bf16 = step_comm("zero3", P, "bf16", world_size=4, nodes=2, group_size=2)
    assert bf16.intra == {"all_gather": 2 * 0.5 * 2 * P, "reduce_scatter": 0.5 * MB}
    z1 = step_comm("zero1", P, "bf16", world_size=4, nodes=2, group_size=2)
    assert z1.inter == {"all_reduce": 2 * 3 / 4 * MB + flags(4)} and z1.intra == {"all_gather": 0.5 * MB}
    ddp = step_comm("ddp", P, "fp32", world_size=4, nodes=2)
    assert ddp.inter == {"all_reduce": 2 * 3 / 4 * MB + flags(4)} and ddp.intra == {}
    assert bf16.inter == {"all_reduce": 2 * 1 / 2 * MB / 2 + flags(4)}
    assert step_comm("zero3", P, "fp32", world_size=1).intra == {}
    with pytest.raises(ValueError, match="groups of 3"):
        step_comm("zero3", P, "fp32", world_size=8, nodes=2, group_size=3)


def test_world_layout_from_the_flags() -> None:
    assert world_layout(None, None, None) == (1, 1)
    assert world_layout(8, None, None) == (8, 1)
    assert world_layout(None, 2, 4) == (8, 2)
    assert world_layout(8, 2, 4) == (8, 2)  # consistent: accepted
    assert world_layout(8, 2, None) == (8, 2)
    assert world_layout(None, None, 4) == (4, 1)
    with pytest.raises(ConfigError, match="disagrees"):
        world_layout(6, 2, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "6", "--nodes", "2", "--gpus-per-node", "4"],
         "--gpus 6 disagrees with --nodes 2 x --gpus-per-node 4 = 8; give one or the other"),
        (["--gpus", "7", "--nodes", "2"], "--gpus 7 does not spread evenly over --nodes 2"),
        (["--nodes", "0", "--gpus-per-node", "4"], "--nodes 0: plan for at least 1 node"),
        (["--nodes", "2", "--gpus-per-node", "0"], "--gpus-per-node 0: plan for at least 1 device per node"),
    ],
)
def test_cli_refuses_inconsistent_layouts_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.plan import planner

    monkeypatch.setattr(planner, "_trace_candidates", lambda *a, **k: pytest.fail("traced despite bad input"))
    t0 = time.perf_counter()
    assert cli.main(["plan", "--model", "gpt2", "--gpu-memory", "24GB", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert time.perf_counter() - t0 < 20


def test_request_refuses_a_group_that_does_not_divide() -> None:
    with pytest.raises(PlanError, match="shard_group_size=3 does not divide the 4 devices"):
        PlanRequest(world_size=4, nodes=2, device_memory="1GB",
                    candidates=[Candidate("zero3", shard_group_size=3)]).check()


def test_two_nodes_plan_each_sharding_strategy_hybrid_too() -> None:
    request = PlanRequest(world_size=8, nodes=2, device_memory="1GB", activation_checkpointing=False)
    names = [c.name for c in request.chosen()]
    assert names[:3] == ["ddp", "zero1", "zero1 hybrid 4"]
    assert "zero3 hybrid 4" in names and "zero3 hybrid 4 + offload params" in names
    assert not any("ddp hybrid" in n for n in names)
    one = PlanRequest(world_size=8, device_memory="1GB", activation_checkpointing=False)
    assert all(c.shard_group_size is None for c in one.chosen())


HYBRID = [Candidate("zero2", shard_group_size=2), Candidate("zero3", shard_group_size=2)]
FULL = [Candidate("zero2"), Candidate("zero3")]


def test_plan_table_compares_full_and_hybrid() -> None:
    """4 devices on 2 nodes: the hybrid rows hold more per rank (halves, not quarters) and send
    less across nodes; the table says which wins on the slow link."""
    name = "gpt2-tiny"
    request = PlanRequest(world_size=4, nodes=2, device_memory="1TB", batch=MODELS[name][4], device="cpu",
                          candidates=FULL + HYBRID, workers=2, optimizer=_optimizer(name))
    plan = plan_model(_spec(name), request)
    for s in ("zero2", "zero3"):
        full, hyb = plan.find(s), plan.find(s, shard_group_size=2)
        assert full.comm == step_comm(s, plan.parameters, "fp32", world_size=4, nodes=2)
        assert hyb.comm == step_comm(s, plan.parameters, "fp32", world_size=4, nodes=2, group_size=2)
        assert hyb.comm is not None and full.comm is not None
        assert hyb.comm.inter_bytes < full.comm.inter_bytes and hyb.comm_seconds < full.comm_seconds
        # sharded state: 1/2 of it per rank under hybrid, 1/4 under full sharding
        for part in ("optimizer",):
            assert hyb.breakdown[part] == pytest.approx(2 * full.breakdown[part], rel=0.02)
    text = describe(plan)
    assert "intra  inter" in text and "zero3 hybrid 2" in text
    assert "zero3: full sends" in text and "hybrid wins" in text
    assert plan.find("zero3", shard_group_size=2).settings()["shard_group_size"] == 2


# -- against a real hybrid run -------------------------------------------------------------------
def _measure_hybrid(name: str, candidates: list[Candidate]) -> list[dict[str, Any]]:
    """Per-rank peak of live tensor bytes over 2 real training steps, and the bytes of the
    parameters and optimizer states each rank holds afterwards, per candidate."""
    import shardwise

    spec = _spec(name)
    torch.manual_seed(0)
    template = spec.build(None)
    out = []
    for cand in candidates:
        engine = shardwise.Engine(strategy=cand.strategy, cpu=True, shard_group_size=cand.shard_group_size)
        model = copy.deepcopy(template)
        optimizer = _optimizer(name)(model.parameters())
        live = LiveStorage()
        for t in list(model.parameters()) + list(model.buffers()):
            live.tensor(t)
        with live:
            model, optimizer = engine.prepare(model, optimizer)
            live.peak = live.now
            for _ in range(2):
                loss = model(**spec.make_batch(MODELS[name][4])).loss
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            del loss
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        out.append({"peak": live.peak, "params": sum(t.numel() for t in local)})
        del model, optimizer, engine
        gc.collect()
    return out


def test_hybrid_plan_matches_a_real_hybrid_run() -> None:
    """4 processes in 2 groups of 2: each rank holds half the parameters (zero3), not a quarter,
    and the planned per-rank peak is within the planner's 5% of the measured one."""
    name = "gpt2-tiny"
    measured = spawn(_measure_hybrid, 4, name, HYBRID)
    request = PlanRequest(world_size=4, nodes=2, device_memory="1TB", batch=MODELS[name][4], device="cpu",
                          candidates=HYBRID, workers=2, optimizer=_optimizer(name))
    plan = plan_model(_spec(name), request)
    total = plan.parameters
    report = []
    for cand, real in zip(HYBRID, measured[0]):
        predicted = plan.find(cand.strategy, shard_group_size=2).peak
        err = predicted / real["peak"] - 1
        report.append(f"{cand.name}: predicted {predicted / 2**20:.3f} MiB measured "
                      f"{real['peak'] / 2**20:.3f} MiB ({err:+.2%}), params {real['params']} of {total}")
        assert abs(err) <= TOLERANCE, "\n".join(report)
    zero3 = measured[0][1]["params"]
    assert abs(zero3 - total / 2) <= 64, "\n".join(report)  # FSDP2 pads each shard by < 2 elements
    print("\n".join(report))
