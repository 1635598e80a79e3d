"""shard_group_size on backend="deepspeed": refused in one line at Engine construction; and
ZeRO++ hpZ from a DeepSpeed JSON, which runs as given.

DeepSpeed 0.19.8 removed MiCS (`mics_shard_size` raises DeepSpeedConfigError), its hybrid
sharding; ZeRO++ hpZ keeps optimizer states sharded over all processes, so it cannot stand in
for a sharding group (see `deepspeed_setup.check_shard_group`). A group of all processes is
plain ZeRO and is accepted. hpZ passes through to DeepSpeed: 4 processes with secondary groups
of 2 train like one plain process (the equivalence tolerances: losses 1e-5, clip norms 1e-5
relative, weights 2e-5).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from planted import caught, planted_here
from spawn import spawn

from shardwise.config import ConfigError, EngineConfig
from shardwise.strategies.deepspeed.setup import check_shard_group, deepspeed_config

REFUSAL = ("is not supported by backend='deepspeed': DeepSpeed 0.19 removed MiCS (mics_shard_size), its "
           "hybrid sharding; use backend='torch' for shard_group_size")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("group", [2, "node"])
def test_a_group_below_the_world_is_refused_on_deepspeed(strategy: str, group: int | str) -> None:
    check_group_refused(strategy, group)


def test_planted_deepspeed_group_accepted_is_caught() -> None:
    """`deepspeed_group_accepted`: a group below the world goes to DeepSpeed, which would shard
    over every process (a silent full sharding); the refusal check fails."""
    with planted_here("deepspeed_group_accepted"):
        caught(check_group_refused, "zero3", 2, must=r"DID NOT RAISE .*ConfigError")


def check_group_refused(strategy: str, group: int | str) -> None:
    from shardwise.strategies.deepspeed import setup

    cfg = EngineConfig.of(backend="deepspeed", strategy=strategy, shard_group_size=group)
    with pytest.raises(ConfigError) as err:
        setup.check_shard_group(cfg, world_size=4, local_world_size=2)  # 2 nodes of 2
    assert str(err.value) == f"shard_group_size={group!r} (groups of 2 of 4 processes) {REFUSAL}"


@pytest.mark.parametrize("group", [None, 4, "node"])
def test_a_group_of_all_processes_is_plain_zero_on_deepspeed(group: int | str | None) -> None:
    cfg = EngineConfig.of(backend="deepspeed", strategy="zero3", shard_group_size=group)
    check_shard_group(cfg, world_size=4, local_world_size=4)  # one node: "node" is everyone


def test_a_group_that_does_not_divide_the_world_is_refused_first() -> None:
    cfg = EngineConfig.of(backend="deepspeed", strategy="zero3", shard_group_size=3)
    with pytest.raises(ConfigError, match="shard_group_size=3 does not divide the 4 processes"):
        check_shard_group(cfg, world_size=4, local_world_size=4)


def test_deepspeed_json_mics_keys_never_reach_deepspeed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A user's JSON keys pass through to DeepSpeed (hpZ too), except MiCS's: those are ours."""
    import json

    import torch

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True,
        "zero_hpz_partition_size": 2, "overlap_comm": False}}))
    cfg = EngineConfig.of(backend="deepspeed", strategy="zero3", deepspeed_config=str(path))
    zero = deepspeed_config(cfg, device=torch.device("cpu"), numel=100)["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["zero_hpz_partition_size"] == 2  # DeepSpeed's own tuning
    assert not {"mics_shard_size", "mics_hierarchical_params_gather"} & set(zero)  # ours: shard_group_size


def _engine(group: int | str) -> str:
    """Build an Engine with a hybrid group; no model is made (the refusal comes first)."""
    import shardwise

    try:
        shardwise.Engine(backend="deepspeed", strategy="zero3", cpu=True, shard_group_size=group)
    except ConfigError as err:
        import sys

        return str(err) + f" | deepspeed imported: {'deepspeed' in sys.modules}"
    return "accepted"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_engine_refuses_a_hybrid_group_before_any_model() -> None:
    """4 processes, groups of 2: every rank refuses at Engine(...), before DeepSpeed is imported."""
    out = spawn(_engine, 4, 2, timeout=300)
    said = f"shard_group_size=2 (groups of 2 of 4 processes) {REFUSAL}"
    assert out == [f"{said} | deepspeed imported: False"] * 4


RUN = {"batch": 2, "accum": 2, "steps": 3, "clip": 0.5}  # 0.5: below every norm, so every step clips


def _hpz_run(ds_json: str) -> tuple[Any, dict[str, tuple[int, int, int | None]]]:
    """W.run_loop's loop under backend='deepspeed' with the JSON's hpZ (its W.Trained, with the
    final weights); plus each parameter's elements, primary and secondary partition sizes on this
    rank (after prepare)."""
    from dataclasses import replace

    import workloads as W

    import shardwise
    from shardwise.strategies.deepspeed.internals import partition_numels

    engine = shardwise.Engine(backend="deepspeed", strategy="zero3", cpu=True, seed=W.SEED,
                              grad_accum_steps=RUN["accum"], deepspeed_config=ds_json)
    full = {n: p.numel() for n, p in W.build("tiny").named_parameters()}
    model, opt, loader = W.prepared(engine, "tiny", batch=RUN["batch"], steps=RUN["steps"])
    # DeepSpeed drops the secondary copy after each step and rebuilds it at the next gather: read at rest
    parts = {n: (full[n], *partition_numels(p)) for n, p in engine.unwrap_model(model).named_parameters()}
    trained = W.train(engine, model, opt, loader, clip=RUN["clip"])
    return replace(trained, state=engine.get_state_dict(model)), parts


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_hpz_from_a_deepspeed_json_runs_and_matches_one_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """4 processes, ZeRO-3 with hpZ groups of 2: each rank keeps 1/4 of every parameter and a
    secondary 1/2 copy, and the run trains like one plain process."""
    import json

    import workloads as W

    path = tmp_path / "hpz.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}))
    outs = spawn(_hpz_run, 4, str(path), timeout=900)
    ref = W.reference("tiny", world=4, batch=RUN["batch"], accum=RUN["accum"], steps=RUN["steps"],
                      clip=RUN["clip"])
    for _, parts in outs:
        for name, (full, primary, secondary) in parts.items():
            assert primary == -(-full // 4), name  # DeepSpeed pads each partition up to 1/4
            assert secondary is not None and secondary == -(-full // 2), name
    run = outs[0][0]
    assert W.close(run.losses, ref.losses) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(run.norms, ref.norms, strict=True)) < 1e-5
    assert all(n > RUN["clip"] for n in ref.norms)  # the clip changed every step
    assert W.max_diff(run.state, ref.state) < 2e-5
