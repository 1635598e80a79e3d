"""The private torch names shardwise touches, each behind one function here.

torch has no public spelling for these; keeping them in one module means a torch upgrade is
checked in one place (`tests/test_layering.py` fails on a private name read anywhere else, save
nn.Module's `_parameters`/`_buffers`/`_modules` dictionaries, which torch itself documents for
subclass authors); checked against torch 2.13.0. The planner's fake process group keeps its own
(`plan/fakes.py`), DeepSpeed's are in `strategies/deepspeed/internals.py`.

Tensors
- `DTensor._local_tensor`: the rank's shard of a DTensor without an autograd node
  (`DTensor.to_local()` records one when grad mode is on).
- `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: where a shard sits.
- `torch.distributed.tensor.placement_types._StridedShard`: a dimension split in runs (tensor
  parallelism's fused query/key/value: each rank's third of each of q, k, v), not one block.
- `torch._subclasses.fake_tensor.is_fake`: a FakeTensor (or a wrapper of one) in the planner's trace.
- `Tensor._base`: the tensor a view was made from.
- `torch.utils._pytree.tree_map`: torch's own nested-container walk.
- `torch.nn.init._no_grad_trunc_normal_`: the body of `trunc_normal_`, which skips a meta tensor.
- `DTensor(local, DTensorSpec(...), requires_grad=...)`: a DTensor around a local part left where
  it is (`with_local`): `DTensor.from_local` and `distribute_tensor` move the local part to the
  mesh's device, a GPU copy of an offloaded or staged host shard. `DeviceMesh(..., _init_backend=
  False)`: a mesh of the same ranks on the local part's device type, for a cut with no communication.
- `Tensor._version`: the count of in-place writes to a tensor's memory (shared by its views).
- `torch.multiprocessing.reductions.StorageWeakRef`: a weak reference to a tensor's storage,
  equal for every tensor on that storage (its `_weak_ref()` pointer); torch's own meta
  conversion keys storages by it.

Optimizers (`torch.optim.optimizer`)
- `_global_optimizer_pre_hooks` / `_global_optimizer_post_hooks`, and an optimizer's
  `_optimizer_step_pre_hooks` / `_optimizer_step_post_hooks`: the step hooks `Optimizer.step` runs.
- `Optimizer._opt_called`: set by a step; an LR scheduler warns when it steps before one.
- `Optimizer._step_supports_amp_scaling`: the step unscales a GradScaler's gradients itself
  (fused kernels do).

DistributedDataParallel
- `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`: parameters DDP neither
  broadcasts nor all-reduces (zero1's split experts; the only spelling torch has, used by its own
  tests and by torchrec).

Process groups and the launcher
- `DeviceMesh._flatten`: several dimensions of a mesh as one named dimension (torchtitan and
  Accelerate make their `dp_cp`/`dp_shard_cp` views with it).
- `torch.distributed.distributed_c10d._get_default_store`: the default group's TCP store.
- `torch.distributed.distributed_c10d._world.pg_map`: the process groups this process is a member of.
- `torch.distributed.elastic.multiprocessing.api._terminate_process_handler`: the function
  torchrun's agent installs for every signal it stops on.
- `torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter`: FSDP2's pluggable reduce-scatter
  interface (torch >= 2.8; None before).
- FSDP2's per-module state, `module._get_fsdp_state()._fsdp_param_groups[*].fsdp_params`, and an
  FSDPParam's `_unsharded_param`: the gathered parameter, counted by `shardwise.runtime.memory`.

Autograd
- `torch._C._current_graph_task_id()`: the backward autograd's engine is running on this thread
  (-1: none); a non-reentrant activation checkpoint recomputes its forward inside one. DeepSpeed
  ZeRO-3 tells a recompute by it too (`partitioned_param_coordinator`).

Compilation (`torch._dynamo`)
- `torch._dynamo.utils.counters`: dynamo's per-process counters; `["stats"]["unique_graphs"]`
  counts the graphs compiled (`strategies.compile` tells a recompilation by it).
- `torch._dynamo.exc.Unsupported`: what `torch.compile(fullgraph=True)` raises at a graph break.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup, Store
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

try:  # FSDP2's pluggable collectives (torch >= 2.8); the interface lives in a private module
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2's own reduce-scatter is used
    FSDPReduceScatter = None  # type: ignore[assignment,misc]

Hook = Callable[..., Any]

__all__ = [
    "FSDPReduceScatter", "allow_amp_scaling", "ddp_ignore", "default_store", "dynamo_graphs",
    "graph_break_error", "holds_partitions", "holds_shards", "in_backward", "is_fake", "is_sharded",
    "is_strided", "is_strided_shard", "local_part", "local_tensor", "mark_stepped",
    "member_groups", "no_grad_trunc_normal", "one_block_placements", "shard_box", "shard_like",
    "step_post_hooks",
    "step_pre_hooks", "storage_ref", "strided_shard", "terminate_handler", "tree_map", "version_of",
    "view_base", "with_local",
]


# -- autograd --------------------------------------------------------------------------------------
def in_backward() -> bool:
    """A backward is running on this thread: a module called now is an activation checkpoint's
    recompute (non-reentrant), not a forward of its own."""
    return torch._C._current_graph_task_id() != -1


# -- tensors ---------------------------------------------------------------------------------------
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage FSDP2 keeps), or `t` itself for a plain tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    """`t` is a DTensor (or DeepSpeed-partitioned tensor is asked elsewhere): a shard of a whole."""
    return isinstance(t, DTensor)


def holds_shards(module: nn.Module) -> bool:
    """Some parameter of `module` is held in part by each process, so its forward is a collective:
    a DTensor (FSDP2, tensor parallelism) or a DeepSpeed ZeRO-3 parameter (`holds_partitions`)."""
    return any(isinstance(p, DTensor) or hasattr(p, "ds_tensor") for p in module.parameters())


def holds_partitions(module: nn.Module) -> bool:
    """Some parameter of `module` is DeepSpeed ZeRO-3's (its partition `ds_tensor` beside it)."""
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


def shard_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's shard of `t` within the whole tensor
    (`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def local_part(full: torch.Tensor, t: DTensor) -> torch.Tensor:
    """This rank's part of `full` (the whole value) as `t` lays it out, without communication: its
    `shard_box`, or for a strided split (runs of a dimension: not one box) `t`'s own split of it."""
    if not is_strided(t):
        shape, offset = shard_box(t)
        return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    device = local_tensor(t).device
    mesh = t.device_mesh
    if mesh.device_type != device.type:  # (an offloaded shard: cut on the host, never on the GPU)
        mesh = DeviceMesh(device.type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
    return local_tensor(distribute_tensor(full.to(device), mesh, t.placements, src_data_rank=None))


def with_local(local: torch.Tensor, like: DTensor, *, requires_grad: bool = False) -> DTensor:
    """A DTensor laid out as `like` (mesh, placements, global shape and stride) whose local part
    is `local` itself, wherever it lives. `DTensor.from_local` would move `local` to the mesh's
    device: a host copy (a staged checkpoint, offloaded optimizer state) copied back to the GPU."""
    assert tuple(local.shape) == shard_box(like)[0], (tuple(local.shape), shard_box(like)[0])
    spec = DTensorSpec(like.device_mesh, tuple(like.placements),
                       tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=requires_grad)


def shard_like(whole: torch.Tensor, like: DTensor, *, dtype: torch.dtype | None = None) -> DTensor:
    """`whole` (every process holds the same values) cut as `like` is, without communication, its
    local part a fresh tensor on `like`'s local device: the host for an offloaded parameter, never
    the mesh's device (where `distribute_tensor` would put it)."""
    part = local_part(whole.detach(), like)
    return with_local(part.to(local_tensor(like).device, dtype or whole.dtype, copy=True), like)


def is_fake(t: torch.Tensor) -> bool:
    """`t` is a FakeTensor (the planner's trace), or a tensor subclass wrapping one."""
    from torch._subclasses.fake_tensor import is_fake as torch_is_fake

    return bool(torch_is_fake(t))


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (`Tensor._base`), or None when `t` owns its memory."""
    return t._base


def version_of(t: torch.Tensor) -> int:
    """How many in-place writes `t`'s memory has had (`Tensor._version`; a view shares its base's)."""
    return int(t._version)


def storage_ref(t: torch.Tensor) -> Any:
    """A weak, hashable reference to `t`'s storage (`StorageWeakRef`): equal for every tensor on
    the same memory, `expired()` once the memory is freed, and while it lives no other storage
    takes its address."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`fn` applied to every leaf of nested lists, tuples and dicts (torch's pytree)."""
    from torch.utils._pytree import tree_map as torch_tree_map

    return torch_tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of `tree` as torch's pytree sees them (FSDP2 finds a forward's output tensors so)."""
    from torch.utils._pytree import tree_leaves as torch_tree_leaves

    return list(torch_tree_leaves(tree))


def no_grad_trunc_normal() -> Callable[..., torch.Tensor]:
    """`torch.nn.init._no_grad_trunc_normal_`, the function `trunc_normal_` calls (it returns
    early on a meta tensor, so an init recorder must know its code object)."""
    return torch.nn.init._no_grad_trunc_normal_


# -- optimizers ----------------------------------------------------------------------------------
def step_pre_hooks(optimizer: torch.optim.Optimizer) -> list[Hook]:
    """The step pre-hooks `optimizer.step()` would run: the global ones, then its own."""
    from torch.optim import optimizer as torch_optimizer

    return list(itertools.chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                                optimizer._optimizer_step_pre_hooks.values()))


def step_post_hooks(optimizer: torch.optim.Optimizer) -> list[Hook]:
    """The step post-hooks `optimizer.step()` would run: the global ones, then its own."""
    from torch.optim import optimizer as torch_optimizer

    return list(itertools.chain(torch_optimizer._global_optimizer_post_hooks.values(),
                                optimizer._optimizer_step_post_hooks.values()))


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that `optimizer` stepped, as its own `step()` does, for a step run some other way
    (an LR scheduler stepped before any optimizer step warns)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def allow_amp_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Tell a GradScaler that `optimizer`'s step unscales the gradients itself (a fused kernel
    does), where its class declares the flag."""
    if hasattr(optimizer, "_step_supports_amp_scaling"):
        optimizer._step_supports_amp_scaling = True


def strided_shard(dim: int, split_factor: int) -> Placement:
    """Dimension `dim` split into `split_factor` runs, each run split over the mesh dimension: a
    rank holds its part of every run (the runs of a fused q/k/v: split_factor 3)."""
    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(p: Placement) -> bool:
    """`p` is a `strided_shard` (not a `Shard` subclass in every torch)."""
    return isinstance(p, _StridedShard)


def is_strided(t: DTensor) -> bool:
    """`t` is split in runs of a dimension somewhere (one of its placements is a `strided_shard`)."""
    return any(is_strided_shard(p) for p in t.placements)


def one_block_placements(placements: Sequence[Placement]) -> list[Placement] | None:
    """`placements` with every dimension that a `strided_shard` splits last made a plain `Shard`,
    so that each rank holds one block of the tensor; None when each rank already does.

    torch's distributed checkpoint describes a shard by one box (offset and shape), which a rank
    holding several runs of a dimension does not fit: tensor parallelism's fused query/key/value
    (`strided_shard(dim, 3)`) lays its columns out that way. A `strided_shard` that a plain `Shard`
    of the same dimension splits again afterwards (FSDP2 sharding a tensor-parallel shard) still
    leaves one block per rank and is kept."""
    last: dict[int, Placement] = {}
    for p in placements:
        if isinstance(p, Shard) or is_strided_shard(p):
            last[p.dim] = p  # type: ignore[attr-defined]  # both kinds split a dimension
    strided = {d for d, p in last.items() if is_strided_shard(p)}
    if not strided:
        return None
    return [Shard(p.dim) if is_strided_shard(p) and p.dim in strided else p  # type: ignore[attr-defined]
            for p in placements]


# -- process groups and the launcher -------------------------------------------------------------
def member_groups() -> list[ProcessGroup]:
    """Every process group this process is a member of (the default one included)."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def default_store() -> Store:
    """The default process group's key-value store (a `torch.distributed.Store`); raises when
    there is no default group."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


@contextlib.contextmanager
def terminate_handler(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """Inside, torchrun's elastic agent calls `handler(signum, frame)` for each signal it stops
    on (it installs this module function as the signal handler when it starts); the agent's
    own is put back after."""
    import torch.distributed.elastic.multiprocessing.api as elastic_api

    before = elastic_api._terminate_process_handler
    elastic_api._terminate_process_handler = handler  # type: ignore[assignment]  # a patched function
    try:
        yield
    finally:
        elastic_api._terminate_process_handler = before


def fsdp_params(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(shard, gathered parameter or None) of each parameter FSDP2 manages at `module` (its
    `_get_fsdp_state()._fsdp_param_groups[*].fsdp_params`, `sharded_param`, `_unsharded_param`);
    empty for a module `fully_shard` was not applied to. torch has no public view of the gathered
    parameter, which the module registers only while it is in use."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return []
    return [(fp.sharded_param, getattr(fp, "_unsharded_param", None))
            for group in getattr(get_state(), "_fsdp_param_groups", []) for fp in group.fsdp_params]


# -- compilation -----------------------------------------------------------------------------------
def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (`torch._dynamo.utils.counters`, its
    `["stats"]["unique_graphs"]`); it only grows."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_break_error() -> type[Exception]:
    """The exception `torch.compile(fullgraph=True)` raises at a graph break
    (`torch._dynamo.exc.Unsupported`)."""
    from torch._dynamo.exc import Unsupported

    return Unsupported


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh` (a DeviceMesh slice of several named dimensions) as one dimension named `name`,
    registered on its root mesh, so `root[name]` finds it (made once: a second call returns it)."""
    return mesh._flatten(name)


def ddp_ignore(model: torch.nn.Module, names: list[str]) -> None:
    """Have a DistributedDataParallel built around `model` leave these parameters alone."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
