"""The strategy table: the one place that knows what each strategy, offload and backend does
(and the names trackers go by).

Everything outside `strategies/`, `config` and `config.translate` asks these specs (a property, a method)
instead of comparing names, so a new strategy, offload or backend is one new entry here
(`tests/test_layering.py` fails on a name comparison elsewhere). `config` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .parallelism import ConfigError


@dataclass(frozen=True, slots=True)
class OffloadSpec:
    """What an offload setting moves to host memory."""

    optimizer_on_host: bool
    """The optimizer states (and the fp32 master weights) live and step on the host."""
    params_on_host: bool
    """The parameters' shards live on the host between uses (stage 3 only)."""

    @property
    def any(self) -> bool:
        """Something lives on the host."""
        return self.optimizer_on_host or self.params_on_host


OFFLOAD_TABLE: dict[str, OffloadSpec] = {
    "none": OffloadSpec(optimizer_on_host=False, params_on_host=False),
    "optimizer": OffloadSpec(optimizer_on_host=True, params_on_host=False),
    "params": OffloadSpec(optimizer_on_host=True, params_on_host=True),
}


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What an engine backend does beyond the strategy's own work."""

    distributed_type: str | None
    """The Accelerate `DistributedType` name every strategy of it reports (None: the strategy's own)."""
    sync_each_batch: bool
    """It can force a gradient sync on every micro-batch (Accelerate's `sync_each_batch`)."""
    plans_auto: bool
    """`strategy='auto'` plans for it."""
    compiles_blocks: bool = False
    """`compile: true` compiles each block's forward with torch.compile before it is wrapped."""


BACKEND_TABLE: dict[str, BackendSpec] = {
    "torch": BackendSpec(distributed_type=None, sync_each_batch=True, plans_auto=True, compiles_blocks=True),
    "deepspeed": BackendSpec(distributed_type="DEEPSPEED", sync_each_batch=False, plans_auto=False),
}


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """What a named strategy shards, and what it runs with."""

    stage: int
    """ZeRO stage: 0 shards nothing (ddp), 1 optimizer states, 2 also gradients, 3 also parameters."""
    offloads: tuple[str, ...]
    """Offload settings it supports ("optimizer" needs sharded optimizer states, "params" stage 3)."""
    backends: tuple[str, ...]
    """Backends that run it (DeepSpeed has no ddp)."""
    distributed_type: str
    """The Accelerate `DistributedType` name it reports on the torch backend (on a GPU where the
    name has a CPU twin: MULTI_GPU, MULTI_CPU on CPU processes)."""

    @property
    def shards_optimizer(self) -> bool:
        """Each rank keeps the optimizer states of its own slice only."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Each rank keeps the reduced gradients of its own slice only."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Each rank keeps its slice of every parameter; the whole one is gathered per use."""
        return self.stage >= 3

    @property
    def regathers_in_backward(self) -> bool:
        """Parameters gathered for forward are freed after it and gathered again for backward."""
        return self.shards_params

    def runs(self, backend: str, offload: str = "none") -> bool:
        """The table allows this strategy with `backend` and `offload`."""
        return backend in self.backends and offload in self.offloads


STRATEGY_TABLE: dict[str, StrategySpec] = {
    "ddp": StrategySpec(stage=0, offloads=("none",), backends=("torch",), distributed_type="MULTI_GPU"),
    "zero1": StrategySpec(stage=1, offloads=("none", "optimizer"), backends=("torch", "deepspeed"),
                          distributed_type="FSDP"),
    "zero2": StrategySpec(stage=2, offloads=("none", "optimizer"), backends=("torch", "deepspeed"),
                          distributed_type="FSDP"),
    "zero3": StrategySpec(stage=3, offloads=("none", "optimizer", "params"), backends=("torch", "deepspeed"),
                          distributed_type="FSDP"),
}
STRATEGIES: tuple[str, ...] = tuple(STRATEGY_TABLE)  # what "auto" chooses from
AUTO = "auto"  # the strategy name that asks the planner (`shardwise.plan.auto`)


def strategy_spec(name: str) -> StrategySpec:
    """The spec of a named strategy (validated by the config; 'auto' has none until planned)."""
    return STRATEGY_TABLE[name]


def offload_spec(name: str) -> OffloadSpec:
    """What the offload setting `name` moves to the host."""
    return OFFLOAD_TABLE[name]


def backend_spec(name: str) -> BackendSpec:
    """What the backend `name` does."""
    return BACKEND_TABLE[name]


def is_auto(strategy: str) -> bool:
    """The strategy is left to the planner."""
    return strategy == AUTO


def plan_choices(backend: str = "torch") -> list[tuple[str, str]]:
    """Every (strategy, offload) pair the table allows on `backend`: the planner's candidates."""
    return [(name, off) for name, spec in STRATEGY_TABLE.items() if backend in spec.backends
            for off in spec.offloads]


# -- trackers -------------------------------------------------------------------------------------
TRACKERS = ("jsonl", "tensorboard", "wandb")  # the names `log_with` takes (`runtime.trackers`)


def check_log_with(log_with: Any) -> tuple[str, ...]:
    """Accelerate's `log_with` (a name, a list of names, "all", or None) as a tuple of names."""
    if log_with is None:
        return ()
    items = [log_with] if isinstance(log_with, str) else list(log_with)
    names: list[str] = []
    for item in items:
        name = str(getattr(item, "value", item)).lower()  # Accelerate's LoggerType members are strings
        if name == "all":  # as Accelerate: every tracker that is installed
            import importlib.util

            return ("jsonl", *(t for t, mod in (("tensorboard", "tensorboard"), ("wandb", "wandb"))
                               if importlib.util.find_spec(mod) is not None))
        if name not in TRACKERS:
            raise ValueError(
                f"log_with={item!r} is not a tracker shardwise has; choose from: {', '.join(TRACKERS)}"
            )
        names.append(name)
    return tuple(dict.fromkeys(names))


def check_strategy(strategy: str, offload: str, backend: str) -> None:
    """Refuse a strategy, offload and backend that do not go together (the table's rules)."""
    if strategy == "auto":
        if backend != "torch":
            raise ConfigError(
                f"strategy='auto' plans for the torch backend; with backend={backend!r} name the "
                "strategy (zero1, zero2 or zero3), e.g. the one `shardwise plan` suggests"
            )
        return  # auto plans only among the plans with the offload given
    spec = STRATEGY_TABLE[strategy]
    if backend not in spec.backends:
        names = [n for n, s in STRATEGY_TABLE.items() if backend in s.backends]
        runs = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        raise ConfigError(
            f"strategy={strategy!r} is not run by backend={backend!r}; choose {runs} there, or "
            f"backend={spec.backends[0]!r} for {strategy}"
        )
    if offload not in spec.offloads:
        if offload == "params":
            raise ConfigError(
                f"offload='params' needs strategy='zero3' (got strategy={strategy!r}): only "
                "stage 3 shards parameters. Use offload='optimizer' with zero1/zero2, or zero3."
            )
        raise ConfigError(
            f"offload={offload!r} needs a sharded strategy (zero1, zero2 or zero3), got strategy={strategy!r}"
        )
