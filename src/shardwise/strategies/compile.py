"""Compiling each block with `torch.compile` (`compile: true`).

Each block's own `forward` is replaced, in place, by a compiled one (an instance attribute), the
way activation checkpointing wraps it: the module tree, parameter names, state dict keys,
checkpoints and `save_model` never see a wrapper (no `_orig_mod.`), and FSDP2's and DDP's hooks
stay eager around the compiled code: FSDP2 all-gathers a unit's parameters in its pre-forward hook,
then the compiled graph runs on the gathered parameters, and the reduce-scatter (or DDP's bucketed
all-reduce) fires from the gradient hooks as in eager mode. Every block of one class runs the same
code, so dynamo compiles one graph for all of them (its guards do not pin a module instance).

Compilation is lazy: the first call of a block compiles it. `fullgraph=True` is tried first; a
graph break is reported once per block class (one line on the main process: the class and dynamo's
reason) and the block then runs compiled around the break, or, with `compile_fullgraph: true`, is
an error naming the class, the reason and the fix. A graph compiled after the first optimizer step
(a recompilation) is reported once per block class, never silent; `compile_stats()` counts the
graphs and the engine reports the start-up cost after the second step (`compile_boundary`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..config.tree import BlocksConfig, ConfigError
from ..distributed.internals import dynamo_graphs, graph_break_error

if TYPE_CHECKING:
    from ..distributed.world import DistInfo

log = logging.getLogger("shardwise")
_COMPILED = "_shardwise_compiled"  # set on a module whose forward is already compiled

__all__ = ["CompileOptions", "CompileStats", "apply_compile", "compile_boundary", "compile_options",
           "compile_stats"]


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """What `torch.compile` is called with for every block (from the config's compile_* fields)."""

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    """A graph break is an error (False: reported once, then compiled around the break)."""
    dynamic: bool | None = None


@dataclass(slots=True)
class CompileStats:
    """The compiled blocks of this process's run and what compiling them cost (`compile_stats()`).
    A run begins at the first step boundary of an engine that compiled blocks in its `prepare`;
    the counts start again there."""

    blocks: dict[str, int] = field(default_factory=dict)
    """Compiled blocks that ran, by class name."""
    graphs: int = 0
    """Graphs dynamo compiled while a compiled block ran (one per block class when nothing breaks;
    AOTAutograd compiles each one's backward lazily, in the first backward)."""
    forward_compile_s: float = 0.0
    """Seconds spent in the forward calls that compiled a graph (the backward's compile is not in it)."""
    graph_breaks: dict[str, str] = field(default_factory=dict)
    """Block class -> dynamo's reason, for classes that run compiled around a graph break (this
    process's: a class is tried as one graph once)."""
    recompiles: dict[str, int] = field(default_factory=dict)
    """Block class -> graphs compiled after the first optimizer step (none while shapes stay put)."""
    first_step_s: float | None = None
    """Wall time of the first optimizer step (compiling included), from the engine's step boundaries."""
    next_step_s: float | None = None
    """Wall time of the second optimizer step."""


class _Watch:
    """The process's compile bookkeeping: counts, the step boundaries seen, the lines reported."""

    def __init__(self) -> None:
        self.stats = CompileStats()
        self.pending = False  # blocks were compiled since the last run began (the next run is timed)
        self.run: object = None  # the engine's process info whose step boundaries are seen
        self.timed = False  # that run compiled blocks
        self.after_first_step = False  # a graph compiled from now on is a recompilation
        self.marks: list[tuple[int, float]] = []  # (optimizer step, time) at the first step boundaries
        self.reported = False  # the start-up line

    def called(self, name: str) -> None:
        """A `name` block ran compiled for the first time."""
        self.stats.blocks[name] = self.stats.blocks.get(name, 0) + 1

    def compiled(self, name: str, graphs: int, seconds: float) -> None:
        """A call of a `name` block compiled `graphs` new graphs in `seconds`."""
        self.stats.graphs += graphs
        self.stats.forward_compile_s += seconds
        if self.after_first_step:
            first = name not in self.stats.recompiles
            self.stats.recompiles[name] = self.stats.recompiles.get(name, 0) + graphs
            if first:
                _main_warning(
                    f"compile: a {name} block was compiled again after the first optimizer step (an "
                    "input's shape, dtype or grad mode changed, or a guard failed); each new variant "
                    "costs a compile. TORCH_LOGS=recompiles prints torch's reason")

    def boundary(self, step: int, run: object, say: Callable[[str], None]) -> None:
        """`run`'s engine is between optimizer steps (called more than once per step)."""
        if run is not self.run:  # a new engine's first boundary: time it if it compiled blocks
            self.run, self.timed, self.pending = run, self.pending, False
            self.after_first_step, self.marks, self.reported = False, [], False
            if self.timed:
                self.stats = CompileStats(graph_breaks=dict(_CompiledForward.broken))
        if self.reported or not self.timed:
            return
        if not self.marks or step != self.marks[-1][0]:
            self.marks.append((step, time.perf_counter()))
        if len(self.marks) >= 2:
            self.after_first_step = True
            self.stats.first_step_s = self.marks[1][1] - self.marks[0][1]
        if len(self.marks) < 3:
            return
        first = self.marks[1][1] - self.marks[0][1]
        self.stats.next_step_s = after = self.marks[2][1] - self.marks[1][1]
        self.reported = True
        s = self.stats
        blocks = ", ".join(f"{n} {name} block{'s' * (n > 1)}" for name, n in s.blocks.items())
        broke = [name for name in s.graph_breaks if name in s.blocks]  # this run's classes
        breaks = f"graph breaks in {', '.join(broke)}" if broke else "fullgraph"
        say(f"compile: {blocks}, {s.graphs} graph(s) ({breaks}); first step {first:.2f} s "
            f"(compiling), next step {after:.2f} s: compiling cost about {max(first - after, 0.0):.1f} s")


_WATCH = _Watch()


def _main_warning(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(message)


def compile_stats() -> CompileStats:
    """This process's compiled blocks, graphs, recompilations and start-up times (a live object)."""
    return _WATCH.stats


def compile_boundary(step: int, info: DistInfo) -> None:
    """The engine between optimizer steps (`step` taken so far): from the first step on, a new
    graph is a recompilation; after the second, the start-up line on the main process."""
    from ..runtime.supervision import say

    _WATCH.boundary(step, info, lambda message: say(info, message))


def compile_options(cfg: BlocksConfig) -> CompileOptions:
    """The `torch.compile` settings of `cfg` (checked when the config was built)."""
    mode = None if cfg.compile_mode in (None, "default") else cfg.compile_mode
    return CompileOptions(backend=cfg.compile_backend, mode=mode, fullgraph=cfg.compile_fullgraph,
                          dynamic=cfg.compile_dynamic)


class _CompiledForward:
    """A block's forward, compiled at its first call: fullgraph first; at a graph break, reported
    once per class (or refused with `fullgraph`), compiled around the break."""

    # classes whose forward broke the graph: their other blocks skip the fullgraph attempt
    broken: ClassVar[dict[str, str]] = {}

    def __init__(self, forward: Callable[..., Any], name: str, options: CompileOptions) -> None:
        functools.update_wrapper(self, forward)  # inspect.signature(block.forward) reads the eager one
        self.forward = forward  # the eager forward (the checkpointing wrapper, when there is one)
        self.name = name
        self.options = options
        self.compiled: Callable[..., Any] | None = None

    def _compile(self, fullgraph: bool) -> Callable[..., Any]:
        o = self.options
        fn: Callable[..., Any] = torch.compile(self.forward, backend=o.backend, mode=o.mode,
                                               fullgraph=fullgraph, dynamic=o.dynamic)
        return fn

    def _first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        _WATCH.called(self.name)
        if self.options.fullgraph or self.name not in self.broken:
            whole = self._compile(fullgraph=True)
            try:
                out = whole(*args, **kwargs)
            except graph_break_error() as err:
                reason = (str(err).strip().splitlines() or ["(no reason given)"])[0]
                if self.options.fullgraph:
                    raise ConfigError(
                        f"compile_fullgraph: the forward of {self.name} has a graph break ({reason}); "
                        "remove it from the block's code, or set compile_fullgraph: false to compile "
                        "around it") from err
                self.broken[self.name] = reason
                _WATCH.stats.graph_breaks[self.name] = reason
                _main_warning(f"compile: {self.name} does not compile as one graph ({reason}); its "
                              "blocks run compiled around the break (compile_fullgraph: true makes this "
                              "an error)")
            else:
                self.compiled = whole
                return out
        self.compiled = self._compile(fullgraph=False)
        return self.compiled(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before, start = dynamo_graphs(), time.perf_counter()
        out = self._first_call(args, kwargs) if self.compiled is None else self.compiled(*args, **kwargs)
        new = dynamo_graphs() - before
        if new:
            _WATCH.compiled(self.name, new, time.perf_counter() - start)
        return out


def apply_compile(modules: Sequence[nn.Module], options: CompileOptions) -> None:
    """Compile each module's own `forward` in place (an instance attribute), before sharding.

    The module keeps its class, children and parameter names; FSDP2's or DDP's hooks, applied
    later, run eagerly around the compiled forward. A module already compiled is left as it is.
    """
    if not modules:
        raise ConfigError("compile: true found nothing to compile; name the blocks with wrap=(...)")
    for module in [m for m in modules if not getattr(m, _COMPILED, False)]:
        module.forward = _CompiledForward(module.forward, type(module).__name__, options)
        setattr(module, _COMPILED, True)
    _WATCH.pending = True
