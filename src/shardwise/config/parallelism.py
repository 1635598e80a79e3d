"""The `parallelism` section: the sizes of the run's named mesh dimensions, and the one function
that resolves them for a world of processes (`resolve_sizes`).

The dimensions (torchtitan's `ParallelDims` is the model), outermost first:
  dp_replicate  groups holding the same shards (DDP's replicas; hybrid sharding's groups);
  dp_shard      data-parallel ranks that shard parameters, gradients or optimizer state (zero1-3);
  cp            context parallelism (sequences split along their length);
  tp            tensor parallelism (each planned layer split; consecutive ranks, within a node);
  ep            expert parallelism, borrowed from dp_shard x cp (not a factor of the world).
dp_replicate x dp_shard x cp x tp is the number of processes. A size may be -1 for "the
processes the others leave" (dp_replicate or dp_shard, one of them). Today's flat keys translate
into these sizes here and nowhere else: `tensor_parallel_size` is tp, `shard_group_size` (a count
of processes: whole tp groups) is dp_shard x tp, ddp's ranks are all dp_replicate. Accelerate's
`ParallelismConfig` (`dp_replicate_size`, `dp_shard_size`, `tp_size`, ...) and an Accelerate
YAML's `parallelism_config` fill this section (`config.translate`). Every consumer of a
data-parallel size or rank asks the resolved layout (`distributed.mesh.ParallelDims`), which is
built from `resolve_sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
_REST = -1  # "the processes the others leave"


class ConfigError(ValueError):
    """A configuration value that shardwise refuses; the message names the field and the fix.
    (Defined here, the lowest module of the config, and re-exported by `config.tree`.)"""


ParallelismError = ConfigError


@dataclass(slots=True)
class ParallelismConfig:
    """The sizes of the run's named mesh dimensions (`parallelism:` in a config file).

    None: from the flat keys (strategy, shard_group_size, tensor_parallel_size); -1: the rest."""

    dp_replicate: int | None = None
    """Groups holding the same shards: DDP's replicas, or hybrid sharding's groups (zero1-3 shard
    within a group of dp_shard ranks and all-reduce across the groups). None: what the others
    leave."""
    dp_shard: int | None = None
    """Data-parallel ranks that shard parameters, gradients or optimizer state (zero1-3; ddp: 1).
    None: shard_group_size's ranks, else every data-parallel rank."""
    cp: int = 1
    """Context parallelism: ranks that split each sequence along its length (context_parallel_size;
    torch backend, a transformers model)."""
    tp: int | None = None
    """Tensor parallelism: ranks that split each planned layer (None: tensor_parallel_size)."""
    ep: int = 1
    """Expert parallelism: ranks that split each mixture-of-experts layer's experts, borrowed from
    dp_shard x cp (expert_parallel_size; this version: the torch backend's zero1, zero2 and zero3,
    without cp or tp)."""

    def __post_init__(self) -> None:
        rests = []
        for name in DIMS:
            value = getattr(self, name)
            can_rest = name in ("dp_replicate", "dp_shard")
            if value is None and name in ("dp_replicate", "dp_shard", "tp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and not
                                                                          (can_rest and value == _REST)):
                rest = " or -1 (the rest)" if can_rest else ""
                raise ParallelismError(f"parallelism.{name}={value!r} must be an integer >= 1{rest}")
            if value == _REST:
                rests.append(name)
        if len(rests) > 1:
            raise ParallelismError("parallelism: dp_replicate=-1 and dp_shard=-1 both ask for the rest; "
                                   "give one of them a size")

    def given(self) -> dict[str, int]:
        """The sizes set in the section (not None), by name."""
        return {n: getattr(self, n) for n in DIMS if getattr(self, n) is not None}


@dataclass(frozen=True, slots=True)
class Sizes:
    """A run's resolved sizes (`resolve_sizes`): dp_replicate x dp_shard x cp x tp = world."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @property
    def dp(self) -> int:
        """Data-parallel ranks: different samples per step."""
        return self.dp_replicate * self.dp_shard


def as_section(value: Any) -> ParallelismConfig:
    """The section from a config file's mapping (unknown keys refused by `config.files`)."""
    if isinstance(value, ParallelismConfig):
        return value
    if not isinstance(value, dict):
        raise ParallelismError(f"parallelism={value!r} must be a mapping of {', '.join(DIMS)}")
    return ParallelismConfig(**value)


def tensor_parallel(section: ParallelismConfig, tensor_parallel_size: int) -> int:
    """tp: the section's size or tensor_parallel_size (refused in one line when both are given
    and disagree)."""
    if section.tp is None:
        return tensor_parallel_size
    if tensor_parallel_size not in (1, section.tp):
        raise ParallelismError(f"parallelism.tp={section.tp} and tensor_parallel_size={tensor_parallel_size} "
                               "disagree; set one of them")
    return section.tp


def resolve_sizes(section: ParallelismConfig, *, shards: bool, shard_group: int | None,
                  tensor_parallel_size: int, world: int, local_world: int, group_said: Any = None) -> Sizes:
    """The sizes of a run of `world` processes (`local_world` per node): the one place that
    computes a data-parallel size. `shards`: the strategy shards over dp_shard (zero1-3; ddp and
    ddp-like layouts hold replicas only). `shard_group`: shard_group_size resolved to processes
    (None: not set; `group_said`: as the config wrote it). Each refusal is one line naming the
    sizes and the fix."""
    tp = tensor_parallel(section, tensor_parallel_size)
    check_tp(tp, world, local_world)
    cp = section.cp
    if world % (tp * cp):
        raise ParallelismError(f"parallelism: cp={cp} x tp={tp} does not divide the {world} processes of "
                               "this run; choose sizes whose product divides it")
    dp = world // (tp * cp)
    replicate, shard = section.dp_replicate, section.dp_shard
    if not shards:
        if shard not in (None, 1, _REST) or (shard == _REST and replicate not in (None, _REST, dp)):
            raise ParallelismError(f"parallelism.dp_shard={shard}: this strategy shards nothing (its "
                                   "data-parallel ranks hold replicas): use dp_replicate, or zero1-3")
        shard = 1
        replicate = dp if replicate in (None, _REST) else replicate
    else:
        sized = {n: v for n, v in (("dp_replicate", replicate), ("dp_shard", shard))
                 if v not in (None, _REST)}
        for name, value in sized.items():
            if dp % value:
                raise ParallelismError(f"parallelism.{name}={value} does not divide the {dp} data-parallel "
                                       f"ranks ({world} processes / cp {cp} x tp {tp})")
        if not sized:  # neither given a size: shard_group_size's ranks, else every data-parallel rank
            shard = dp if shard_group is None else _group_ranks(shard_group, tp * cp, group_said)
            replicate = dp // shard
        elif "dp_shard" not in sized:
            shard = dp // sized["dp_replicate"]
        elif "dp_replicate" not in sized:
            replicate = dp // sized["dp_shard"]
        if sized and shard_group is not None and _group_ranks(shard_group, tp * cp, group_said) != shard:
            raise ParallelismError(f"shard_group_size ({shard_group} processes: "
                                   f"{shard_group // (tp * cp)} data-parallel ranks) and parallelism."
                                   f"dp_shard={shard} disagree; set one of them")
    assert isinstance(replicate, int) and isinstance(shard, int)
    if replicate * shard * cp * tp != world:
        raise ParallelismError(f"parallelism: dp_replicate={replicate} x dp_shard={shard} x cp={cp} x "
                               f"tp={tp} = {replicate * shard * cp * tp} is not the {world} processes of "
                               "this run")
    if (shard * cp) % section.ep:
        raise ParallelismError(f"parallelism.ep={section.ep} does not divide dp_shard x cp = {shard * cp}: "
                               "the experts are split over the ranks that shard the model")
    return Sizes(replicate, shard, cp, tp, section.ep)


def _group_ranks(group: int, per_rank: int, said: Any = None) -> int:
    """A sharding group of `group` processes in data-parallel ranks of `per_rank` processes."""
    if group % per_rank:
        raise ParallelismError(
            f"shard_group_size={group if said is None else said!r} ({group} processes) does not hold whole "
            f"tensor-parallel groups of {per_rank} processes: choose a multiple of tensor_parallel_size="
            f"{per_rank} (a group of G processes is G / {per_rank} data-parallel ranks)")
    return group // per_rank


def check_tp(tp: int, world: int, local_world: int) -> None:
    """tp divides the world and, across nodes, the processes of a node (its all-reduces, one per
    rowwise layer, stay within a node)."""
    if tp == 1:
        return
    if world % tp:
        raise ParallelismError(f"tensor_parallel_size={tp} does not divide the {world} processes of this "
                               "run; choose a divisor")
    if world > local_world and local_world % tp:
        raise ParallelismError(f"tensor_parallel_size={tp} does not divide the {local_world} processes per "
                               "node: its all-reduces would cross nodes; choose a divisor of the processes "
                               "per node")


def data_parallel_size(section: ParallelismConfig, tensor_parallel_size: int, world: int) -> int:
    """Data-parallel ranks of `world` processes before a strategy is chosen (the batch checks of
    the command line): the processes over cp x tp (a size that does not divide: the world, left
    to `resolve_sizes` to refuse)."""
    try:
        per_rank = tensor_parallel(section, tensor_parallel_size) * section.cp
    except ParallelismError:
        return world
    return world // per_rank if per_rank >= 1 and not world % per_rank else world


__all__ = ["DIMS", "ConfigError", "ParallelismConfig", "ParallelismError", "Sizes", "as_section", "check_tp",
           "data_parallel_size", "resolve_shard_group", "resolve_sizes", "tensor_parallel"]


def resolve_shard_group(value: int | str | None, world_size: int, local_world_size: int) -> int:
    """The processes per sharding group for `shard_group_size=value` in a world of `world_size`
    (`local_world_size` per node); refused in one line when it does not divide the world."""
    group = world_size if value is None else local_world_size if value == "node" else int(value)
    if group < 1 or world_size % group:
        said = f"{value!r} ({group} processes per node)" if value == "node" else repr(value)
        raise ConfigError(
            f"shard_group_size={said} does not divide the {world_size} processes of this run into "
            f"equal groups; choose a divisor of {world_size} (e.g. the processes per node) or None"
        )
    return group
