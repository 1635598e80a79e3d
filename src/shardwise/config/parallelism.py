"""The `parallelism` section: the sizes of the run's named mesh dimensions, and the one function
that resolves them for a world of processes (`resolve_sizes`).

The dimensions (torchtitan's `ParallelDims` is the model), outermost first:
  dp_replicate  groups holding the same shards (DDP's replicas; hybrid sharding's groups);
  dp_shard      data-parallel ranks that shard parameters, gradients or optimizer state (zero1-3);
  cp            context parallelism (sequences split along their length);
  tp            tensor parallelism (each planned layer split; consecutive ranks, within a node);
  ep            expert parallelism, borrowed from dp_shard x cp (not a factor of the world).
dp_replicate x dp_shard x cp x tp is the number of processes. A size may be -1 for "the
processes the others leave" (dp_replicate or dp_shard, one of them). The section is where the
sizes live: the flat keys `tensor_parallel_size`, `context_parallel_size` and
`expert_parallel_size` are only other spellings of tp, cp and ep (`config.tree.FLAT_KEYS`), and
`shard_group_size` (a count of processes: whole cp x tp groups) resolves to dp_shard here and
nowhere else; ddp's ranks are all dp_replicate. Accelerate's
`ParallelismConfig` (`dp_replicate_size`, `dp_shard_size`, `tp_size`, ...) and an Accelerate
YAML's `parallelism_config` fill this section (`config.translate`). Every consumer of a
data-parallel size or rank asks the resolved layout (`distributed.mesh.ParallelDims`), which is
built from `resolve_sizes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
_REST = -1  # "the processes the others leave"


class ConfigError(ValueError):
    """A configuration value that shardwise refuses; the message names the field and the fix.
    (Defined here, the lowest module of the config, and re-exported by `config.tree`.)"""


ParallelismError = ConfigError


TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_loss_parallel", "embedding_rowwise",
             "colwise_qkv", "replicate")


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """The run's named mesh dimensions and how each splits the model (`parallelism:`): the sizes
    dp_replicate, dp_shard, cp, tp, ep (their product, ep aside, is the number of processes; -1:
    the rest), the tensor-parallel plan, and your own model-parallel step. The flat keys
    tensor_parallel_size, context_parallel_size and expert_parallel_size are tp, cp and ep;
    shard_group_size is dp_shard x cp x tp processes. Each backend refuses, in one line, a
    dimension it does not split."""

    dp_replicate: int | None = None
    """Groups holding the same shards: DDP's replicas, or hybrid sharding's groups (zero1-3 shard
    within a group of dp_shard ranks and all-reduce across the groups). None: what the others
    leave."""
    dp_shard: int | None = None
    """Data-parallel ranks that shard parameters, gradients or optimizer state (zero1-3; ddp: 1).
    None: shard_group_size's ranks, else every data-parallel rank."""
    cp: int = 1
    """Processes that split each sequence along its length (context parallelism; flat key
    context_parallel_size): they take the same samples, each holds 1/N of every sequence's tokens
    and activations, and attention spans the whole sequence (`cp_method`). A transformers model
    (its attention is replaced through transformers' attention registry); ddp and zero1-3, hybrid
    sharding and tensor parallelism compose with it. Torch backend."""
    tp: int = 1
    """Processes that split each layer of the model between them (tensor parallelism, flat key
    tensor_parallel_size; innermost on the mesh: consecutive ranks, so within a node); they see the
    same batch, and the data is split over world / (cp x tp) data-parallel ranks. With ddp, zero2
    or zero3 (torch backend): the layers are split first, then replicated or sharded over the
    data-parallel ranks. The model needs a plan (a transformers model's own, or tp_plan)."""
    ep: int = 1
    """Processes that split each mixture-of-experts layer's experts (expert parallelism, flat key
    expert_parallel_size), borrowed from dp_shard x cp: each holds 1/N of every layer's experts, and
    each token goes to the ranks that own its chosen experts and back (two all-to-alls, no token
    dropped). transformers' fused experts modules (Mixtral, Qwen2-MoE, ...) or a user's layer of the
    same layout. zero1, zero2 or zero3 (offload included, hybrid sharding too), N dividing the
    sharding group. Torch backend."""
    tp_plan: dict[str, str] | None = None
    """Module path (`*` matches one name) -> how it is split (flat key tensor_parallel_plan):
    colwise, rowwise, colwise_gather_output, colwise_loss_parallel (the head's logits left split:
    compute the loss under `engine.loss_parallel()`), embedding_rowwise, replicate (None: the
    model's own plan)."""
    sequence_parallel: bool = False
    """With tp > 1: the activations between the split layers (norms, residuals, dropouts) split
    over the sequence across the tp ranks too, instead of whole on each (the all-reduces become
    all-gathers and reduce-scatters of the same bytes). The sequence length must divide by tp.
    Torch backend."""
    cp_method: Literal["ring", "ulysses"] = "ring"
    """How attention spans a split sequence (flat key context_parallel): ring (key/value blocks
    passed round the group, a zigzag split that balances the causal mask; any head count) or
    ulysses (two all-to-alls per attention: sequence shards to head shards and back; the heads
    must divide by cp)."""
    parallelize: str | Callable[..., Any] | None = None
    """Your own model-parallel step for a model with no plan: a function `parallelize(model,
    dims)` (or its "module:function" name) that splits `model` in place on the meshes of `dims`
    (`engine.parallel_dims`: `dims.get_mesh("tp")`, ...), as Lightning Fabric's
    ModelParallelStrategy takes one. It replaces the tensor-parallel plan step; activation
    checkpointing, compile and the data-parallel sharding follow as usual. Torch backend."""

    def __post_init__(self) -> None:
        rests = []
        for name in DIMS:
            value = getattr(self, name)
            can_rest = name in ("dp_replicate", "dp_shard")
            if value is None and can_rest:
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
        self._check_model_parallel()

    def _check_model_parallel(self) -> None:
        """The plan, sequence_parallel, the cp method and the user's own step, each on its own."""
        plan = self.tp_plan
        valid = isinstance(plan, dict) and all(isinstance(k, str) and v in TP_STYLES for k, v in plan.items())
        if plan is not None and not valid:
            raise ConfigError(f"tensor_parallel_plan={plan!r} must map module paths to one of "
                              f"{', '.join(TP_STYLES)}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel={self.sequence_parallel!r} must be true or false")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel: true splits the activations over the tensor-parallel "
                              "ranks: set tensor_parallel_size above 1 with it, or leave sequence_parallel "
                              "off")
        if self.cp_method not in ("ring", "ulysses"):
            raise ConfigError(f"context_parallel={self.cp_method!r} must be ring or ulysses")
        fn = self.parallelize
        if fn is not None and not callable(fn) and not (isinstance(fn, str) and ":" in fn):
            raise ConfigError(f"parallelize={fn!r} must be a function parallelize(model, dims) or its "
                              "'module:function' name")

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


def resolve_sizes(section: ParallelismConfig, *, shards: bool, shard_group: int | None,
                  world: int, local_world: int, group_said: Any = None) -> Sizes:
    """The sizes of a run of `world` processes (`local_world` per node): the one place that
    computes a data-parallel size. `shards`: the strategy shards over dp_shard (zero1-3; ddp and
    ddp-like layouts hold replicas only). `shard_group`: shard_group_size resolved to processes
    (None: not set; `group_said`: as the config wrote it). Each refusal is one line naming the
    sizes and the fix."""
    tp = section.tp
    check_tp(tp, world, local_world)
    cp = section.cp
    if world % (tp * cp):
        raise ParallelismError(f"parallelism: cp={cp} x tp={tp} does not divide the {world} processes of "
                               "this run; choose sizes whose product divides it")
    dp = data_parallel_size(section, world)
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
            shard = dp if shard_group is None else _group_ranks(shard_group, cp, tp, group_said)
            replicate = dp // shard
        elif "dp_shard" not in sized:
            shard = dp // sized["dp_replicate"]
        elif "dp_replicate" not in sized:
            replicate = dp // sized["dp_shard"]
        if sized and shard_group is not None and _group_ranks(shard_group, cp, tp, group_said) != shard:
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


def _group_ranks(group: int, cp: int, tp: int, said: Any = None) -> int:
    """A sharding group of `group` processes in data-parallel ranks of cp x tp processes; a group
    that cuts one is refused naming the dimensions in use (context, tensor parallel or both)."""
    per_rank = cp * tp
    if group % per_rank:
        used = [(kind, key, size) for kind, key, size in (("context", "context_parallel_size", cp),
                                                          ("tensor", "tensor_parallel_size", tp)) if size > 1]
        kinds = " x ".join(kind for kind, _, _ in used)
        sizes = " x ".join(f"{key}={size}" for _, key, size in used)
        raise ParallelismError(
            f"shard_group_size={group if said is None else said!r} ({group} processes) does not hold whole "
            f"{kinds}-parallel groups of {per_rank} processes: choose a multiple of {sizes}"
            f"{f' = {per_rank}' if len(used) > 1 else ''} (a group of G processes is G / {per_rank} "
            "data-parallel ranks)")
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


def data_parallel_size(section: ParallelismConfig, world: int) -> int:
    """Data-parallel ranks of `world` processes: the processes over cp x tp, the one place this
    is computed (`resolve_sizes` splits it into dp_replicate x dp_shard; the batch checks ask it
    before a strategy is chosen). A size that does not divide gives the world, left to
    `resolve_sizes` to refuse."""
    per_rank = section.tp * section.cp
    return world // per_rank if per_rank >= 1 and not world % per_rank else world


__all__ = [
    "DIMS",
    "TP_STYLES",
    "ConfigError",
    "ParallelismConfig",
    "ParallelismError",
    "Sizes",
    "as_section",
    "check_tp",
    "data_parallel_size",
    "resolve_shard_group",
    "resolve_sizes",
]


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
