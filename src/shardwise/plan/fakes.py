"""Making our real training code run in one process on fake ranks and fake tensors.

Torch's "fake" process-group backend answers every collective without communicating; FakeTensor
gives every tensor a shape and dtype but no data. DDP needs two small concessions (see
`fake_ddp`); everything else (FSDP2, our sharded optimizer, offload) runs unchanged.

This module is also the planner's shim: the private torch names the planner needs are touched
here only, each behind a function or a re-export (checked against torch 2.13.0):

- `torch._C._distributed_c10d.FakeProcessGroup` and its `_create_internal`: the fake backend;
  `dist.Backend._plugins`: whether it is registered already.
- `torch.distributed.distributed_c10d`'s registry: `_world` (its default_pg, group_count,
  pg_coalesce_state, comms), `_pg_map`, `_pg_names`, `_pg_group_ranks`, `_pg_backend_config`,
  `_tags_to_pg`, `_pg_to_tag`, `_unregister_all_process_groups`, `_update_default_pg`,
  `_register_process_group`: set aside and restored around the fake world (`fake_world`).
- DDP's reducer `_rebuild_buckets` (`fake_ddp`) and `torch.nn.parallel.distributed`'s
  `_verify_param_shape_across_processes` (`no_ddp_shape_check`).
- `torch.utils._python_dispatch.TorchDispatchMode` (re-exported as `DispatchMode`),
  `torch.utils._pytree.tree_leaves` / `tree_map`, `torch._subclasses.fake_tensor.FakeTensorMode`
  (`fake_mode`), `torch._guards.detect_fake_mode` (`current_fake_mode`),
  `torch._subclasses.fake_tensor.unset_fake_temporarily` (`real_mesh_slices`) and `is_fake`.
- `torch._C._distributed_c10d.ProcessGroup.unbox` and c10d's `_resolve_process_group`
  (`process_group_ranks`: the group a collective's argument names).
- `torch.distributed.tensor.debug._clear_sharding_prop_cache` (`_forget_shardings`): DTensor caches
  each op's output sharding by a mesh's shape and names, not its process groups, so a fake
  world's sharding (and its group names) would otherwise serve the next world's mesh of the same
  shape: another fake world's, or a live job's.
- `DeviceMesh._concatenate` (`real_mesh_slices`: FSDP2 joins the dp and tp meshes).
- `UntypedStorage._cdata` (`storage_key`: the address that names a storage while it lives) and
  an operator's `_overloadpacket` (`overload_packet`: the key of torch's FLOP formulas).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "DispatchMode", "current_fake_mode", "even_routing", "fake_copy", "fake_ddp", "fake_mode", "fake_world",
    "is_fake",
    "no_ddp_shape_check", "overload_packet", "patched", "process_group_ranks", "real_mesh_slices",
    "storage_key",
    "tree_leaves", "tree_map",
]


# -- private torch names, each behind a function ------------------------------------------------
def fake_mode() -> Any:
    """A FakeTensorMode that also accepts real tensors as inputs (the user's built model)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = FakeTensorMode(allow_non_fake_inputs=True)
    return m


def current_fake_mode() -> Any:
    """The fake mode now active (None outside one)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode()


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a fake tensor (shape and dtype, no data)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def storage_key(st: torch.UntypedStorage) -> int:
    """The address of a storage's implementation: the same for every view while it lives."""
    return int(st._cdata)


def process_group_ranks(obj: Any) -> list[int] | None:
    """The ranks of the process group a collective's argument names: boxed (c10d's ops) or by
    its registered name (functional collectives: DTensor's); None for any other argument."""
    from torch.distributed import distributed_c10d as c10d

    if isinstance(obj, str):  # resolved where c10d registers it (a name is reused by the next
        # fake world of the same process: `pg_names` may still hold the last world's group)
        try:
            return list(dist.get_process_group_ranks(c10d._resolve_process_group(obj)))  # type: ignore[arg-type]
        except (RuntimeError, ValueError):  # not a group's name
            return None
    if not isinstance(obj, torch.ScriptObject):
        return None
    try:
        boxed = torch._C._distributed_c10d.ProcessGroup.unbox(obj)
    except RuntimeError:  # another boxed argument: a ReduceOp, a Work
        return None
    return list(dist.get_process_group_ranks(boxed))


def overload_packet(func: Any) -> Any:
    """The overload packet of an aten operator (what `flop_counter.flop_registry` is keyed by)."""
    return func._overloadpacket


@contextlib.contextmanager
def real_mesh_slices() -> Iterator[None]:
    """A device mesh sliced inside the fake mode (FSDP2 takes the "shard" dimension of a hybrid
    2-D mesh per parameter) or joined there (FSDP2 over tensor-parallel weights joins the dp and
    tp meshes: `DeviceMesh._concatenate`) computes its coordinates from real tensors: fake ones
    hold no data."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__getitem__
    static = DeviceMesh.__dict__["_concatenate"]  # a staticmethod: restored as it was
    concatenate = static.__func__

    def getitem(mesh: DeviceMesh, names: Any) -> DeviceMesh:
        with unset_fake_temporarily():
            return original(mesh, names)

    def concat(meshes: Any) -> DeviceMesh:
        with unset_fake_temporarily():
            return cast(DeviceMesh, concatenate(meshes))

    with patched(DeviceMesh, "__getitem__", getitem):
        DeviceMesh._concatenate = staticmethod(concat)  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            DeviceMesh._concatenate = static  # type: ignore[method-assign]


def no_ddp_shape_check() -> contextlib.AbstractContextManager[None]:
    """DDP compares parameter shapes across ranks by reading tensor data; fake ranks agree."""
    from torch.nn.parallel import distributed as ddp_module

    return patched(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None)


# -- a private world of fake ranks -------------------------------------------------------------
def _register_fake_backend() -> None:
    if "fake" in getattr(dist.Backend, "_plugins", {}):
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: Any, backend_opts: Any) -> Any:
        return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
            common.group_rank, common.group_size, backend_opts
        )

    dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])


_C10D_MAPS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Rank 0 of a fake process group of `world_size` ranks is the default group inside.

    A process that already has a real default group (a training script planning at `prepare`)
    gets it back afterwards untouched: its c10d registry entries are set aside and restored; no
    collective is issued on it.
    """
    from torch.distributed import distributed_c10d as c10d

    _register_fake_backend()
    hidden = dist.is_initialized()
    if hidden:
        saved_maps = {name: dict(getattr(c10d, name)) for name in _C10D_MAPS}
        saved = (c10d._world.default_pg, c10d._world.group_count, dict(c10d._world.pg_coalesce_state),
                 list(c10d._world.comms))
        for name in _C10D_MAPS:
            getattr(c10d, name).clear()
        c10d._world.pg_coalesce_state.clear()
        c10d._world.comms.clear()
        c10d._unregister_all_process_groups()
        c10d._update_default_pg(None)
        c10d._world.group_count = 0
    try:
        _forget_shardings()
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
        yield
    finally:
        _forget_shardings()
        if dist.is_initialized():
            dist.destroy_process_group()
        if hidden:
            for name, value in saved_maps.items():
                getattr(c10d, name).update(value)
            default_pg, count, coalesce, comms = saved
            c10d._world.pg_coalesce_state.update(coalesce)
            c10d._world.comms.extend(comms)
            c10d._world.group_count = count
            c10d._update_default_pg(default_pg)
            for pg, name in saved_maps["_pg_names"].items():
                c10d._register_process_group(name, pg)


def _forget_shardings() -> None:
    """Drop DTensor's cached output shardings (see the module docstring): they hold the meshes,
    and so the process-group names, of the world they were computed in."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """`transformers`' test for packed sequences answered as for the planner's batches.

    Without a KV cache (activation checkpointing turns it off), `transformers` reads the
    position ids to tell whether several sequences are packed in one row; a fake tensor has no
    data, so it would assume they are, and build a (batch, 1, seq, seq) causal mask that a real
    run, whose position ids count 0..seq-1, skips for SDPA's `is_causal` (one mask per layer
    kept for backward: batch x seq^2 bytes that dominate at long sequences). Here a fake
    tensor's rows count as one sequence each; a real batch is still read."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return

    def unpacked(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if is_fake(position_ids) else cast(torch.Tensor | None, find(position_ids))

    with patched(masking_utils, "find_packed_sequence_indices", unpacked):
        yield


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` inside (and what it was again after)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# -- making DDP run on fake tensors -------------------------------------------------------------
class _NoRebuildReducer:
    """DDP's reducer, except that it never rebuilds its buckets (that step reads tensor data,
    which fake tensors have none of). The rebuild only reorders buckets; their total is the same."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def fake_ddp(model: nn.Module, on_bucket: Callable[[torch.Tensor], None]) -> None:
    """A DDP model all-reduces through `on_bucket` (no collective) and never rebuilds buckets."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return

    def allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks these annotations
        # The fake group's all-reduce returns no tensor; an in-place all-reduce of the bucket
        # allocates nothing, so completing with the bucket itself is the same for memory.
        buf = bucket.buffer()
        on_bucket(buf)
        fut = torch.futures.Future()  # type: ignore[var-annotated]
        fut.set_result(buf)
        return fut

    model.register_comm_hook(None, allreduce)
    model.reducer = _NoRebuildReducer(model.reducer)  # type: ignore[assignment]


def fake_copy(model: nn.Module, fake_mode: Any) -> nn.Module:
    """A structural copy of `model` whose parameters and buffers are fake (nothing allocated)."""
    memo: dict[int, Any] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:  # a model built empty (init_empty): its fake tensors live where it will
            with fake_mode:
                return torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return cast(torch.Tensor, fake_mode.from_tensor(t.detach()))

    for p in model.parameters():
        memo[id(p)] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake(b)
    return copy.deepcopy(model, memo)


def _even(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes that differ by at most one, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@contextlib.contextmanager
def even_routing() -> Iterator[None]:
    """Expert parallelism's routing (`strategies.expert_parallel.routes`) as an even split: fake
    tensors hold no router output, so a trace plans the balanced routing that the load-balancing
    loss aims at. Of a rank's T x k token slots, each rank of the group receives an equal share
    and, from each rank, as many as it sends; its local experts take equal shares of what it
    receives. A skewed routing moves and computes more on the busiest rank than planned. The
    step's (edp, ep) meshes are built from real tensors and kept apart from a live job's. Without
    expert parallelism, transformers' grouped_mm experts run through its fallback operator, whose
    fake kernel gives the same shapes (torch's grouped_mm has none for fp32)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh as build

    from ..strategies import expert_parallel

    def init_mesh(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return build(*args, **kwargs)

    def even(top_k_index: torch.Tensor, experts: int, group: dist.ProcessGroup) -> Any:
        n = dist.get_world_size(group)
        tokens, k = top_k_index.shape
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        source_token = torch.arange(tokens, device=top_k_index.device).repeat_interleave(k)[order]
        send = _even(tokens * k, n)
        recv = [send[dist.get_rank(group)]] * n
        sizes = _even(sum(recv), experts // n)
        expert_of = torch.cat([torch.full((s,), e, dtype=torch.long, device=top_k_index.device)
                               for e, s in enumerate(sizes)])
        per_expert = torch.zeros(experts, dtype=torch.long, device=top_k_index.device)
        return expert_parallel.Routes(order, source_token, per_expert, send, recv, expert_of, sizes)

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(expert_parallel, "routes", even))
        stack.enter_context(patched(expert_parallel, "_MESHES", {}))
        stack.enter_context(patched(expert_parallel, "init_device_mesh", init_mesh))
        moe: Any = None
        with contextlib.suppress(ImportError):
            from transformers.integrations import moe
        if moe is not None and hasattr(moe, "_can_use_grouped_mm"):
            # transformers' default experts (grouped_mm) at ep 1: torch's grouped_mm has no fake
            # kernel for fp32; transformers' own fallback op of the same shapes has one
            stack.enter_context(patched(moe, "_can_use_grouped_mm", lambda *a: False))
        yield
