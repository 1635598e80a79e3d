"""Careless inputs under tensor parallelism that once trained the wrong model with no word
(issue 48's probe), each now against one plain process (fp32) or refused in one line:

  zero1 + tp 2 at one data-parallel rank   the zero1 runner split one step over every process
                                           (its group None meant "all": the tp ranks stepped
                                           different shards, split weights moved 2.2x too far);
  GPT-2's tied embeddings + a plan that splits wte alone   untied them silently;
  train_batch_size under tp                counted processes, not data-parallel ranks: 16 asked,
                                           8 trained per step; a 2-process checkpoint resumed at
                                           4 processes with tp 2 halved the accumulation;
  strategy auto + tensor_parallel_size 2   dropped tp (and doubled the global batch);
  shard_group_size under tp                counted data-parallel ranks where the docs say
                                           processes: 2 at 4 processes with tp 2 ran full sharding;
  a loader under dp 2 x tp 2               now a line at prepare says it is split over 2
                                           data-parallel ranks, not 4 processes.
Tolerances as tests/test_tensor_parallel.py: losses, clipped norms and final weights within 1e-5
(tp changes the order of the sums inside a matmul).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted_here
from spawn import spawn
from torch.utils.data import DataLoader

TOL, WEIGHT_TOL = 1e-5, 2e-5  # losses and norms; final weights (measured: up to 5.8e-6)


@dataclass(frozen=True, slots=True)
class Run:
    """A run's micro-batch losses, clipped norms, final weights (process 0), the accumulation
    it resolved, its layout (dp_replicate, dp_shard, tp) and the engine's lines at prepare."""

    losses: list[float]
    norms: list[float]
    state: dict[str, torch.Tensor]
    accum: int
    layout: tuple[int, int, int]
    lines: list[str] = field(default_factory=list)
    strategy: str = ""


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(engine: Any, *, name: str, batch: int, samples: int, load: str | None = None,
         save: str | None = None, steps: int | None = None) -> Run:
    """`name` with AdamW on a shuffled loader of `samples` samples, per-rank `batch`, clipped at
    1.0 (below every norm here); `steps` optimizer steps (None: the whole loader)."""
    lines = _Lines()
    logging.getLogger("shardwise").addHandler(lines)
    logging.getLogger("shardwise").setLevel(logging.INFO)
    model = W.build(name)
    opt = W.make_optimizer(model)
    model, opt, loader = engine.prepare(model, opt, DataLoader(W.Tokens(samples), batch_size=batch,
                                                               shuffle=True))
    if load is not None:
        engine.load_state(load)
    losses, norms = [], []
    for ids in loader:
        with engine.accumulate(model):
            loss = W.lm_loss(model, ids)
            engine.backward(loss)
            losses.append(engine.reduce(loss.detach(), "mean").item())
            if engine.sync_gradients:
                norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        if steps is not None and engine.step >= steps and engine.sync_gradients:
            break
    if save is not None:
        engine.save_state(save)
    dims = engine.session.strategy.dims
    logging.getLogger("shardwise").removeHandler(lines)
    return Run(losses, norms, engine.get_state_dict(model), engine.config.training.grad_accum_steps,
               (dims.dp_replicate, dims.dp_shard, dims.tp), lines.lines, engine.config.sharding.strategy)


def _case(out: dict[str, Any], key: str, make: Any, **kw: Any) -> None:
    """out[key]: the run of `_run(make(), **kw)`, or the one-line error it raised (both ranks
    raise alike: a refusal at construction or prepare), so each case is judged on its own."""
    from shardwise.config import ConfigError

    try:
        engine = make()
        out[key] = _run(engine, **kw)
        engine.free_memory()
    except ConfigError as err:
        out[key] = f"refused: {err}"


def _two(folder: str) -> dict[str, Any]:
    import shardwise
    from shardwise.config import ConfigError
    from shardwise.config.tree import LaunchConfig
    from shardwise.strategies.tensor_parallel import model_plan

    out: dict[str, Any] = {}

    def engine(**kw: Any) -> Any:
        return shardwise.Engine(cpu=True, seed=W.SEED, **kw)

    # zero1 + tp 2 at one data-parallel rank: 4 steps of batch 2
    _case(out, "zero1", lambda: engine(strategy="zero1", tensor_parallel_size=2), name="llama", batch=2,
          samples=8)
    # train_batch_size 16 with accumulation 2 and batch 4 at tp 2 on 2 processes: one
    # data-parallel rank, so 16 takes 4 micro-batches (it trained 8 per step before)
    _case(out, "batch 16", lambda: engine(strategy="zero2", tensor_parallel_size=2, train_batch_size=16,
                                          grad_accum_steps=2), name="llama", batch=4, samples=32)
    # the true batch, as `shardwise launch` writes it for 2 processes: accepted, 8 per step
    _case(out, "batch 8", lambda: engine(strategy="zero2", tensor_parallel_size=2, micro_batch_size=8,
                                         train_batch_size=8, launch=LaunchConfig(num_processes=2)),
          name="llama", batch=8, samples=16)
    # auto with tp 2: planned with tp, kept
    _case(out, "auto", lambda: engine(strategy="auto", tensor_parallel_size=2), name="llama", batch=2,
          samples=8)
    # a 2-process checkpoint of train_batch_size 16 (batch 4 x accumulation 2 x 2 processes),
    # written for 2 processes, resumed at 4 with tp 2 by `_four`
    _case(out, "before resume", lambda: engine(strategy="zero2", train_batch_size=16, grad_accum_steps=2,
                                               launch=LaunchConfig(num_processes=2)),
          name="llama", batch=4, samples=32, steps=1, save=f"{folder}/batch16")
    # GPT-2's tied embeddings with a plan that splits wte alone: refused at prepare
    plan = {**model_plan(W.build("gpt2"), None), "transformer.wte": "embedding_rowwise"}
    e = engine(strategy="zero3", tensor_parallel_size=2, tensor_parallel_plan=plan)
    try:
        e.prepare(W.build("gpt2"))
        out["tied"] = "prepared"
    except ConfigError as err:
        out["tied"] = str(err)
    e.free_memory()
    return out


def _four(folder: str) -> dict[str, Any]:
    import shardwise
    from shardwise.config import ConfigError
    from shardwise.config.tree import LaunchConfig

    out: dict[str, Any] = {}

    def engine(**kw: Any) -> Any:
        return shardwise.Engine(cpu=True, seed=W.SEED, **kw)

    # the 2-process checkpoint, at 4 processes with tp 2 (2 data-parallel ranks): accumulation 2
    _case(out, "resumed", lambda: engine(strategy="zero2", tensor_parallel_size=2, train_batch_size=16,
                                         grad_accum_steps=2, launch=LaunchConfig(num_processes=2)),
          name="llama", batch=4, samples=32, load=f"{folder}/batch16")
    # shard_group_size counts processes: 2 = one tp pair per group, 2 replicas; 4 = everything
    for group in (2, 4):
        _case(out, f"group {group}", lambda g=group: engine(strategy="zero3", tensor_parallel_size=2,
                                                           shard_group_size=g),
              name="llama", batch=2, samples=16)
    # a group that would cut a tp pair in two: refused before any work
    try:
        engine(strategy="zero3", tensor_parallel_size=4, shard_group_size=2)
        out["group 2 of tp 4"] = "built"
    except ConfigError as err:
        out["group 2 of tp 4"] = str(err)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("careless")


@pytest.fixture(scope="module")
def two(folder: Path) -> list[dict[str, Any]]:
    return spawn(_two, 2, str(folder))


@pytest.fixture(scope="module")
def four(folder: Path, two: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return spawn(_four, 4, str(folder))  # (after `two`: it resumes `two`'s checkpoint)


def _check_equal(run: Run | str, ref: W.Trained, state: dict[str, torch.Tensor] | None = None) -> None:
    assert isinstance(run, Run), run  # (a refusal string)
    assert W.close(run.losses, ref.losses) < TOL, (run.losses, ref.losses)
    assert W.close(run.norms, ref.norms) < TOL, (run.norms, ref.norms)
    assert W.max_diff(state if state is not None else run.state, ref.state) < WEIGHT_TOL


def test_zero1_with_tp_at_one_data_parallel_rank_matches_one_process(two: list[dict[str, Any]]) -> None:
    ref = W.reference("llama", world=1, batch=2, accum=1, steps=4)
    for rank in two:
        _check_equal(rank["zero1"], ref, two[0]["zero1"].state)


def test_train_batch_size_counts_data_parallel_ranks_under_tp(two: list[dict[str, Any]]) -> None:
    """16 asked at batch 4 on one data-parallel rank: 4 micro-batches a step, said in a line;
    the true batch 8 accepted as written."""
    sixteen = two[0]["batch 16"]
    assert isinstance(sixteen, Run), sixteen
    assert sixteen.accum == 4
    assert any("1 data-parallel rank(s) (2 processes / tp 2) x batch 4: grad_accum_steps 2 -> 4" in line
               for line in sixteen.lines), sixteen.lines
    _check_equal(sixteen, W.reference("llama", world=1, batch=4, accum=4, steps=2))
    eight = two[0]["batch 8"]
    assert isinstance(eight, Run), eight
    assert eight.accum == 1
    _check_equal(eight, W.reference("llama", world=1, batch=8, accum=1, steps=2))


def test_a_batch_checkpoint_resumed_at_4_processes_with_tp_keeps_the_global_batch(
        two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """16 per step at 2 processes (batch 4 x 2 x 2), then at 4 processes with tp 2: still 2 data-
    parallel ranks, so accumulation stays 2 (it became 1 before); the whole run equals one process
    on global batches of 16."""
    ref = W.reference("llama", world=2, batch=4, accum=2, steps=2)
    before, after = two[0]["before resume"], four[0]["resumed"]
    assert isinstance(before, Run) and isinstance(after, Run), (before, after)
    assert before.accum == after.accum == 2
    assert not any("grad_accum_steps" in line for line in after.lines), after.lines
    assert W.close(before.losses + after.losses, ref.losses) < TOL
    assert W.close(before.norms + after.norms, ref.norms) < TOL
    assert W.max_diff(after.state, ref.state) < WEIGHT_TOL


def test_auto_keeps_the_asked_tensor_parallelism(two: list[dict[str, Any]]) -> None:
    run = two[0]["auto"]
    assert isinstance(run, Run), run
    assert run.layout[2] == 2 and run.strategy != "auto", (run.layout, run.strategy)
    for rank in two:
        _check_equal(rank["auto"], W.reference("llama", world=1, batch=2, accum=1, steps=4),
                     two[0]["auto"].state)


def test_shard_group_size_counts_processes_under_tp(four: list[dict[str, Any]]) -> None:
    ref = W.reference("llama", world=2, batch=2, accum=1, steps=4)
    assert all(isinstance(four[0][case], Run) for case in ("group 2", "group 4")), four[0]
    assert four[0]["group 2"].layout == (2, 1, 2)  # 2 replicas of one tp pair each
    assert four[0]["group 4"].layout == (1, 2, 2)  # every process: zero3 over the 2 dp ranks
    for case in ("group 2", "group 4"):
        for rank in four:
            _check_equal(rank[case], ref, four[0][case].state)
    said = four[0]["group 2"].lines
    assert any("split over 2 data-parallel rank(s), not 4 processes" in line for line in said), said


def test_careless_tp_layouts_are_refused_in_one_line(two: list[dict[str, Any]],
                                                    four: list[dict[str, Any]]) -> None:
    for rank in two:
        assert rank["tied"].startswith("tensor_parallel_plan: transformer.wte (embedding_rowwise) and "
                                       "lm_head (not split) share one weight"), rank["tied"]
        assert "\n" not in rank["tied"]
    for rank in four:
        said = rank["group 2 of tp 4"]
        assert said.startswith("shard_group_size=2 (2 processes) does not hold whole tensor-parallel "
                               "groups of 4"), said
        assert "\n" not in said


def test_batch_rules_in_process() -> None:
    check_batch_rules()


def test_planted_tp_batch_counts_processes_is_caught() -> None:
    """`tp_batch_counts_processes`: the batch counted per process under tp; the in-process check
    of the probe's sizes fails."""
    with planted_here("tp_batch_counts_processes"):
        caught(check_batch_rules,
               must=r"^train_batch_size 16 at micro-batch 4 on 2 processes under tp 2: "
                    r"grad_accum_steps 2, not 4")


def check_batch_rules() -> None:
    """The resolution itself, at the sizes of the probe (no process group needed)."""
    from shardwise.config import ConfigError, EngineConfig, check_train_batch, resolve_grad_accum
    from shardwise.config.tree import LaunchConfig

    cfg = EngineConfig.of(tensor_parallel_size=2, train_batch_size=16, grad_accum_steps=2)
    accum = resolve_grad_accum(cfg, 4, 2)
    assert accum == 4, \
        f"train_batch_size 16 at micro-batch 4 on 2 processes under tp 2: grad_accum_steps {accum}, " \
        "not 4 (1 data-parallel rank)"
    assert resolve_grad_accum(cfg, 4, 4) == 2  # 2 data-parallel ranks
    written = EngineConfig.of(tensor_parallel_size=2, train_batch_size=8, grad_accum_steps=1,
                           launch=LaunchConfig(num_processes=2))
    check_train_batch(written, 8, 2)  # the true batch: accepted
    with pytest.raises(ConfigError) as err:
        check_train_batch(written, 4, 2)
    assert str(err.value) == ("train_batch_size=8 but micro_batch_size 4 x grad_accum_steps 1 x 1 "
                              "data-parallel ranks (2 processes / tensor_parallel_size 2) = 4")
