"""One configuration the planner compares: a strategy, an offload, a hybrid sharding group and an
activation-checkpointing mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.parallelism import ParallelismConfig, Sizes, resolve_sizes
from ..config.tree import ConfigError, OffloadSpec, StrategySpec, offload_spec, strategy_spec

AC_MODES = ("none", "full", "selective", "offload")


class PlanError(ConfigError):
    """A value `shardwise plan` refuses; the message names it (the CLI exits with code 2)."""


def check_checkpointing(mode: Any, every: Any = None) -> None:
    """Refuse an unknown activation-checkpointing mode, or `every` off selective, in one line."""
    if mode not in AC_MODES:
        raise PlanError(f"activation_checkpointing={mode!r} is not valid; choose one of: "
                        + ", ".join(AC_MODES))
    if every is not None and (mode != "selective" or isinstance(every, bool) or not isinstance(every, int)
                              or every < 1):
        raise PlanError(f"activation_checkpointing_every={every!r} needs "
                        "activation_checkpointing='selective' and an integer >= 1")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration the planner compares."""

    strategy: str
    offload: str = "none"
    activation_checkpointing: str = "none"
    """none, full, selective or offload (`EngineConfig.activation_checkpointing`; a bool given is
    read as full or none)"""
    shard_group_size: int | None = None
    """hybrid sharding: processes per sharding group (None: all processes, full sharding)"""
    activation_checkpointing_every: int | None = None
    """selective only: every k-th block checkpointed in full, the others keep everything"""
    tensor_parallel_size: int = 1
    """tensor parallelism: the planned layers split over this many ranks (ddp, zero2, zero3),
    the strategy then over world / tensor_parallel_size data-parallel ranks"""
    sequence_parallel: bool = False
    """with tensor parallelism: the activations between the split layers split over the sequence
    too (`EngineConfig.sequence_parallel`)"""
    expert_parallel_size: int = 1
    """expert parallelism: every mixture-of-experts layer's experts split over this many ranks of
    the sharding group (zero1, zero2, zero3; `EngineConfig.expert_parallel_size`)"""

    def __post_init__(self) -> None:
        ac: Any = self.activation_checkpointing
        if isinstance(ac, bool):
            object.__setattr__(self, "activation_checkpointing", "full" if ac else "none")
        check_checkpointing(self.activation_checkpointing, self.activation_checkpointing_every)

    @property
    def checkpointed(self) -> bool:
        """Some activation checkpointing mode is on."""
        return self.activation_checkpointing != "none"

    @property
    def strategy_spec(self) -> StrategySpec:
        """What the strategy shards (`config.STRATEGY_TABLE`)."""
        return strategy_spec(self.strategy)

    @property
    def offload_spec(self) -> OffloadSpec:
        """What the offload setting keeps on the host (`config.OFFLOAD_TABLE`)."""
        return offload_spec(self.offload)

    @property
    def name(self) -> str:
        """How the plan table names it, e.g. "zero3 + offload params + AC", "zero2 hybrid 8"."""
        off = f" + offload {self.offload}" if self.offload_spec.any else ""
        hybrid = f" hybrid {self.shard_group_size}" if self.shard_group_size is not None else ""
        tp = f" + tp {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        tp += " + sp" if self.sequence_parallel else ""
        tp += f" + ep {self.expert_parallel_size}" if self.expert_parallel_size > 1 else ""
        return f"{self.strategy}{hybrid}{tp}{off}{self.checkpointing_label}"

    @property
    def checkpointing_label(self) -> str:
        """" + AC" for full checkpointing, " + AC selective", " + AC selective/2" (every 2nd
        block), " + AC offload"; "" without."""
        mode, every = self.activation_checkpointing, self.activation_checkpointing_every
        if mode == "none":
            return ""
        return " + AC" + ("" if mode == "full" else f" {mode}") + (f"/{every}" if every else "")

    def sizes(self, world_size: int) -> Sizes:
        """This candidate's mesh sizes on `world_size` processes, resolved as a run resolves its
        own (`config.parallelism.resolve_sizes`: the one place a data-parallel size is computed;
        `shard_group_size` here counts data-parallel ranks, the config counts processes)."""
        tp = self.tensor_parallel_size
        group = None if self.shard_group_size is None else self.shard_group_size * tp
        sharded = self.strategy_spec.stage >= 1
        return resolve_sizes(ParallelismConfig(tp=tp, ep=self.expert_parallel_size), shards=sharded,
                             shard_group=group, world=world_size, local_world=world_size)

    def sharding_group(self, world_size: int) -> int:
        """Processes that share the sharded state among themselves: its group under hybrid
        sharding (every rank holds 1/G of it), else all `world_size`."""
        return world_size if self.shard_group_size is None else self.shard_group_size
