"""`compile: true`: each block compiled with torch.compile (CPU inductor, fp32) trains the model one
plain process trains, on ddp, zero1, zero2, zero3 and with each activation-checkpointing mode, at
2 processes; no graph is compiled after the first optimizer step; names, checkpoints and
save_model are those of an eager run (no `_orig_mod.`). Graph breaks, refusals and Accelerate's
dynamo settings are checked in this process.

Tolerances: losses within 1e-5 (as tests/test_equivalence.py), final weights within 5e-5 of one
plain process and of the same strategy's eager run (test_equivalence: 2e-5). Inductor's fused fp32
kernels round differently from eager (gradients within 3.4e-7 relative in one process; the
aot_eager backend, which generates no kernels, is bit-identical), and AdamW's normalized update
grows that in elements whose gradient is near zero. Measured (torch 2.13, CPU inductor, 4 steps
of 2 x 2 micro-batches, lr 1e-3): losses within 9.5e-7 and weights within 3.3e-5 of one plain
process, 2.7e-5 of eager zero3 (eager zero3 itself: 5.8e-6), the same on every case.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted_here
from safetensors import safe_open
from spawn import spawn
from torch import nn

import shardwise
from shardwise.config import ConfigError, EngineConfig
from shardwise.distributed.internals import dynamo_graphs
from shardwise.strategies.compile import compile_stats

# Inductor compiles in this process, not in a pool of workers it would start first (seconds per
# process on 2 cores); set before the workers' forkserver starts, so they inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
RUN = {"batch": 2, "accum": 2, "steps": 4}
CASES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero3+full": {"strategy": "zero3", "activation_checkpointing": "full"},
    "zero3+selective": {"strategy": "zero3", "activation_checkpointing": "selective"},
    "zero3+offload": {"strategy": "zero3", "activation_checkpointing": "offload"},
}
WEIGHTS_TOL, LOSS_TOL = 5e-5, 1e-5


@dataclass(frozen=True, slots=True)
class Compiled:
    """A compiled (or eager) run: losses, dynamo's graph count after each optimizer step, the
    gathered weights, the unwrapped model's state-dict keys and parameter names (sorted), and
    compile_stats' recompiles."""

    losses: list[float]
    graphs: list[int]
    state: dict[str, torch.Tensor]
    keys: list[str]
    names: list[str]
    recompiles: dict[str, int]


def _train(engine_kw: dict[str, Any], folder: Path | None) -> Compiled:
    """workloads.run_loop with the graph count after every optimizer step; with `folder`, a
    checkpoint and save_model of the result."""
    torch.compiler.reset()  # each case compiles afresh (dynamo's cache is per code object)
    engine = shardwise.Engine(cpu=True, seed=W.SEED, grad_accum_steps=RUN["accum"], **engine_kw)
    model, opt, loader = W.prepared(engine, "tiny", batch=RUN["batch"], steps=RUN["steps"])
    graphs: list[int] = []
    start = dynamo_graphs()  # dynamo's own count, not compile_stats
    trained = W.train(engine, model, opt, loader, at_step=lambda: graphs.append(dynamo_graphs() - start))
    state = engine.get_state_dict(model)
    keys = sorted(engine.unwrap_model(model).state_dict())
    names = sorted(n for n, _ in model.named_parameters())
    if folder is not None:
        engine.save_state(folder / "ckpt")
        engine.save_model(model, folder / "model")
    return Compiled(trained.losses, graphs, state, keys, names, dict(compile_stats().recompiles))


def _all_cases(folder: str) -> dict[str, Compiled]:
    out = {name: _train({"compile": True, **cfg}, Path(folder) / name if name == "zero3" else None)
           for name, cfg in CASES.items()}
    out["eager zero3"] = _train({"strategy": "zero3"}, Path(folder) / "eager")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Compiled], Path]:
    folder = tmp_path_factory.mktemp("compile")
    return spawn(_all_cases, 2, str(folder))[0], folder  # rank 0 holds the full state dicts


@pytest.fixture(scope="module")
def ref() -> W.Trained:
    return W.reference("tiny", world=2, **RUN)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_training_equals_one_process(case: str, runs: tuple[dict[str, Compiled], Path],
                                              ref: W.Trained) -> None:
    run = runs[0][case]
    assert W.close(run.losses, ref.losses) < LOSS_TOL
    assert W.max_diff(run.state, ref.state) < WEIGHTS_TOL
    # one graph at least, all of them compiled in the first step; none in the 3 steps after it
    assert run.graphs[0] >= 1 and run.graphs == [run.graphs[0]] * RUN["steps"], run.graphs
    assert run.recompiles == {}


def test_compiled_equals_eager_and_keeps_its_names(runs: tuple[dict[str, Compiled], Path]) -> None:
    from shardwise.checkpoint.sharded import read_meta

    results, folder = runs
    compiled, eager = results["zero3"], results["eager zero3"]
    assert W.close(compiled.losses, eager.losses) < LOSS_TOL
    assert W.max_diff(compiled.state, eager.state) < WEIGHTS_TOL
    assert eager.graphs == [0] * RUN["steps"] and compiled.graphs == [1] * RUN["steps"]
    for compiled_names, eager_names in ((compiled.keys, eager.keys), (compiled.names, eager.names)):
        assert compiled_names == eager_names and not any("_orig_mod" in k for k in compiled_names)
    assert sorted(compiled.state) == sorted(W.build("tiny").state_dict())

    def meta_names(run: str) -> list[str]:  # the parameter names a checkpoint records
        return sorted(read_meta(folder / run / "ckpt")["models"][0]["params"])

    assert meta_names("zero3") == meta_names("eager") == sorted(W.build("tiny").state_dict())

    def saved_keys(run: str) -> list[str]:
        with safe_open(str(folder / run / "model" / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    assert saved_keys("zero3") == saved_keys("eager") == sorted(W.build("tiny").state_dict())


# -- in this process ------------------------------------------------------------------------------
class Branchy(W.Block):
    """A block with a real graph break: Python branches on a tensor's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.sum() > 0:
            return y * 2
        return y


class BranchyLM(W.TinyLM):
    def __init__(self) -> None:
        super().__init__(layers=2)
        self.blocks = nn.ModuleList(Branchy(32) for _ in range(2))


def _branchy_engine(**kw: Any) -> tuple[Any, nn.Module, nn.Module]:
    torch.compiler.reset()
    torch.manual_seed(0)
    eager = BranchyLM()
    model = BranchyLM()
    model.load_state_dict(eager.state_dict())
    engine = shardwise.Engine(cpu=True, strategy="ddp", compile=True, compile_backend="aot_eager", **kw)
    return engine, engine.prepare(model), eager


def test_graph_break_is_reported_once_and_compiled_around(caplog: pytest.LogCaptureFixture) -> None:
    check_graph_break(caplog)


def test_planted_compile_skipped_is_caught(caplog: pytest.LogCaptureFixture) -> None:
    """`compile_skipped`: compile never applied; no block is compiled and no break reported."""
    with planted_here("compile_skipped"):
        caught(check_graph_break, caplog, must=r"^blocks compiled: \[False, False\]")


def check_graph_break(caplog: pytest.LogCaptureFixture) -> None:
    engine, model, eager = _branchy_engine()
    compiled = _compiled_blocks(engine.unwrap_model(model))
    assert compiled == [True, True], f"blocks compiled: {compiled}"
    ids = W.Tokens(4).data
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        out = [model(ids) for _ in range(3)]
    lines = [r.getMessage() for r in caplog.records if "does not compile as one graph" in r.getMessage()]
    assert len(lines) == 1 and "Branchy" in lines[0] and "Data-dependent branching" in lines[0], lines
    assert compile_stats().graph_breaks["Branchy"] == "Data-dependent branching"
    # compiled around the break: the same numbers as eager (the graphs before and after the branch)
    assert all(torch.allclose(o, eager(ids), atol=1e-6) for o in out)


def test_fullgraph_makes_a_graph_break_an_error() -> None:
    _, model, _ = _branchy_engine(compile_fullgraph=True)
    with pytest.raises(ConfigError, match=r"Branchy has a graph break .*compile_fullgraph: false"):
        model(W.Tokens(2).data)


@pytest.mark.parametrize("kw, match", [
    ({"strategy": "zero3", "backend": "deepspeed"}, r"backend: deepspeed.*use backend: torch"),
    ({"compile_backend": "no_such_backend"}, r"compile_backend='no_such_backend' is not a torch.compile"),
    ({"compile_backend": "aot_eager", "compile_mode": "max-autotune"}, r"is an inductor setting"),
], ids=["deepspeed", "unknown backend", "mode without inductor"])
def test_compile_settings_refused_in_one_line(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        EngineConfig.of(compile=True, **kw)
    assert "\n" not in str(err.value)


def _compiled_blocks(model: nn.Module) -> list[bool]:
    """Which blocks carry their own (compiled) forward instead of their class's."""
    return ["forward" in vars(b) for b in model.blocks]


def _settings(cfg: EngineConfig) -> tuple[Any, ...]:
    b = cfg.blocks
    return b.compile, b.compile_backend, b.compile_mode, b.compile_fullgraph, b.compile_dynamic


def test_accelerator_dynamo_settings_map_to_compile(caplog: pytest.LogCaptureFixture) -> None:
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    with caplog.at_level(logging.WARNING, logger="shardwise"):
        acc = shardwise.Accelerator(cpu=True, dynamo_backend="inductor")
    assert _settings(acc.config) == (True, "inductor", None, False, None)
    assert any("Accelerate compiles the whole model; shardwise compiles each block" in r.getMessage()
               for r in caplog.records)
    assert not shardwise.Accelerator(cpu=True, dynamo_backend=DynamoBackend.NO).config.blocks.compile

    torch.compiler.reset()
    plugin = TorchDynamoPlugin(backend=DynamoBackend.AOT_EAGER, mode="default", fullgraph=True, dynamic=False,
                               use_regional_compilation=True)
    acc = shardwise.Accelerator(cpu=True, dynamo_plugin=plugin)
    assert _settings(acc.config) == (True, "aot_eager", None, True, False)
    model = acc.prepare(W.build("tiny"))
    before = compile_stats().graphs
    eager = W.build("tiny")
    ids = W.Tokens(2).data
    assert torch.allclose(model(ids), eager(ids), atol=1e-6)
    assert compile_stats().graphs > before and _compiled_blocks(acc.unwrap_model(model)) == [True] * 3
    unwrapped = acc.unwrap_model(model, keep_torch_compile=False)  # nothing to unwrap: the names stay
    assert sorted(unwrapped.state_dict()) == sorted(eager.state_dict())


@pytest.mark.parametrize("kw, match", [
    ({"dynamo_backend": "fx2trt"}, r"compile_backend='fx2trt' is not a torch.compile backend"),
    ({"dynamo_plugin": "options"}, r"options=\{'triton.cudagraphs': True\}: shardwise passes no backend"),
    ({"dynamo_backend": "inductor", "dynamo_plugin": "plain"}, r"pass one of them"),
], ids=["unknown backend", "options", "both"])
def test_accelerator_dynamo_refusals(kw: dict[str, Any], match: str) -> None:
    from accelerate.utils import TorchDynamoPlugin

    plugins = {"options": TorchDynamoPlugin(backend="inductor", options={"triton.cudagraphs": True}),
               "plain": TorchDynamoPlugin(backend="inductor")}
    kw = {k: plugins.get(v, v) if k == "dynamo_plugin" else v for k, v in kw.items()}
    with pytest.raises(ConfigError, match=match):
        shardwise.Accelerator(cpu=True, **kw)


def test_startup_line_and_a_recompilation_after_the_first_step_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.compiler.reset()
    engine = shardwise.Engine(cpu=True, strategy="ddp", compile=True, compile_backend="aot_eager")
    model = W.build("tiny")
    model, opt = engine.prepare(model, W.make_optimizer(model))
    ids = W.Tokens(2).data
    with caplog.at_level(logging.INFO, logger="shardwise"):
        for seq in (8, 8, 8, 6, 5, 7):  # from the 4th step on, shorter sequences: new shapes
            with engine.accumulate(model):
                engine.backward(W.lm_loss(model, ids[:, :seq]))
                opt.step()
                opt.zero_grad()
    messages = [r.getMessage() for r in caplog.records]
    startup = [m for m in messages if m.startswith("compile: 3 Block blocks, 1 graph(s) (fullgraph); first")]
    again = [m for m in messages if "compiled again after the first optimizer step" in m]
    assert len(startup) == 1 and "next step" in startup[0], messages
    assert len(again) == 1 and "a Block block" in again[0], messages
    stats = compile_stats()
    assert stats.graphs >= 2 and stats.recompiles["Block"] == stats.graphs - 1
    assert stats.first_step_s is not None and stats.next_step_s is not None
