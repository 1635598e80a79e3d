"""Optimizer-state sharding (ZeRO-1) and optimizer offload: one mechanism for both.

Each rank owns a contiguous range of elements ("segment") of parameters. The user's optimizer
class is instantiated again over 1-D *master* tensors, one per segment, with the user's
parameter groups; before every step the hyperparameters are copied from the user's optimizer,
so LR schedulers bound to it keep working. For elementwise optimizers (SGD, Adam, AdamW, ...)
the sharded update is exactly the unsharded one; optimizers that need whole-tensor statistics
(LAMB, Adafactor) are not exact under sharding, as with every ZeRO implementation.

Where segments come from (``partition``):
  ``flat``  zero1 over DDP. Parameters are full replicas with full, all-reduced gradients. All
            parameters of one dtype are laid end to end and split into W equal ranges; rank r
            updates range r, then one all-gather (a transient buffer the size of those
            parameters) gives every rank the updated full parameters. Hybrid (a shard `group`
            of G < W processes): W is G, ranges and all-gather are within the group, and every
            group updates the same ranges from the same all-reduced gradients.
  ``local`` zero2/zero3 + optimizer offload. Parameters are FSDP2 DTensors, gradients already
            reduce-scattered; the segment is this rank's whole local shard, nothing to gather.

Where masters live (``host``):
  device    (zero1, no offload) the master *is* a view of the parameter: no copy, the inner
            optimizer writes the parameter in place, its state is 1/W of the unsharded state.
  host      (offload) fp32 copies in host memory (pinned on CUDA). Segments are grouped in
            buckets and pipelined: all gradient copies device->host are queued on a side stream
            up front; the CPU steps bucket i as soon as its copies land, and bucket i's updated
            parameters go back host->device while the CPU steps bucket i+1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..config.tree import EngineConfig, HostKernelName
from ..distributed.host import pinned
from ..distributed.internals import local_tensor, mark_stepped, with_local
from ..distributed.world import DistInfo, host_device
from .base import InPlaceRunner, OptimizerRunner, zero_step
from .host_step import IMPLEMENTATION_KEYS, host_kernel, host_threads, step_on_host, threads, use_fused


def optimizer_runner(optimizer: torch.optim.Optimizer, cfg: EngineConfig, info: DistInfo, *,
                     partition: Literal["flat", "local"] | None, host: bool = False,
                     offloaded: bool = False, dtensors: bool = False,
                     group: dist.ProcessGroup | None = None,
                     apart: dict[int, Ranks] | None = None) -> OptimizerRunner:
    """The runner of `optimizer` for a torch-backend strategy (ddp.py and fsdp.py say what differs).

    `partition` None: the user's optimizer steps the parameters in place; where they live on the
    host (`offloaded`, or a CPU device) with the host kernel (`step_on_host`; `dtensors`: they
    are FSDP2 shards). Otherwise a `ShardedOptimizer` over that partition, its masters on the
    host when `host` (optimizer offload); `group`: the process group a "flat" partition splits
    the elements over (None: every process); `apart`: parameters (by id) split over their own
    ranks instead (zero1's split experts: the ranks holding the same experts).
    """
    if partition is None:
        placed = step_on_host(optimizer, info.device, info.local_world_size, offloaded=offloaded,
                              dtensors=dtensors, kernel=cfg.sharding.host_kernel)
        return InPlaceRunner(optimizer, host=placed)
    return ShardedOptimizer(
        optimizer,
        partition=partition,
        host=host,
        device=info.device,
        bucket_numel=cfg.sharding.offload_bucket_numel,
        local_world_size=info.local_world_size,
        kernel=cfg.sharding.host_kernel,
        group=group,
        apart=apart,
    )


def local_flat(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `t` as a 1-D view (the local shard for a DTensor)."""
    local = local_tensor(t)
    return local.detach().view(-1)


@dataclass(slots=True)
class _Segment:
    param: torch.Tensor  # the model's parameter (full tensor, or a DTensor shard)
    group: int  # index of the user's param group
    start: int  # element range of local_flat(param) this rank updates
    end: int
    master: nn.Parameter  # what the inner optimizer updates
    host_grad: torch.Tensor | None  # host gradient buffer (offload only)
    alias: bool = False  # the master is the parameter's own storage (fp32 on a CPU device)


@dataclass(frozen=True, slots=True)
class Ranks:
    """The processes a flat space's elements are split over: `group` (None: every process), this
    process's index in it and its size; `alone()`: a space only this process holds (zero1's split
    experts at ep = the sharding group), stepped whole, nothing gathered."""

    group: dist.ProcessGroup | None
    rank: int
    world: int

    @staticmethod
    def of(group: dist.ProcessGroup | None) -> Ranks:
        return Ranks(group, dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def alone() -> Ranks:
        return Ranks(None, 0, 1)


@dataclass(slots=True)
class _FlatSpace:
    """Parameters of one dtype, held alike by the same processes, laid end to end (zero1's
    all-gather unit)."""

    params: list[tuple[torch.Tensor, int]]  # (parameter, offset in the space)
    chunk: int  # elements owned per rank: ceil(total / world)
    dtype: torch.dtype
    ranks: Ranks


def _numel(p: torch.Tensor) -> int:
    """The elements of `p` this rank holds (a tensor-parallel DTensor: its tp shard's)."""
    return local_flat(p).numel()


def _flat_spaces(params: list[torch.Tensor], ranks_of: Callable[[torch.Tensor], Ranks]) -> list[_FlatSpace]:
    """One space per dtype and set of processes holding the parameters alike."""
    by_key: dict[tuple[torch.dtype, Ranks], list[torch.Tensor]] = {}
    for p in params:
        by_key.setdefault((p.dtype, ranks_of(p)), []).append(p)
    spaces = []
    for (dtype, ranks), ps in by_key.items():
        placed, offset = [], 0
        for p in ps:
            placed.append((p, offset))
            offset += _numel(p)
        spaces.append(_FlatSpace(placed, math.ceil(offset / ranks.world), dtype, ranks))
    return spaces


def _like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor laid out as its parameter: whole, or (tensor parallelism under zero1) this
    rank's tp shard as a DTensor with the parameter's placements."""
    if not isinstance(p, DTensor):
        return flat.view(p.shape)
    return with_local(flat.view(local_tensor(p).shape), p)  # where `flat` is (the host's, offloaded)


class ShardedOptimizer(OptimizerRunner):
    """Steps the user's optimizer class on this rank's segments only (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        partition: Literal["flat", "local"],
        host: bool,
        device: torch.device,
        bucket_numel: int,
        local_world_size: int = 1,
        kernel: HostKernelName = "torch",
        group: dist.ProcessGroup | None = None,
        apart: dict[int, Ranks] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.partition = partition
        self.host = host
        self.device = device
        # "flat": the processes the elements are split over (None: every process); `apart`: the
        # parameters (by id) other processes hold alike (zero1's split experts)
        ranks, apart = Ranks.of(group), apart or {}
        self.group, self.rank, self.world = ranks.group, ranks.rank, ranks.world  # (most parameters')
        owned = [(gi, p) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]
        self._spaces = (_flat_spaces([p for _, p in owned], lambda p: apart.get(id(p), ranks))
                        if partition == "flat" else [])
        pin = host and device.type == "cuda"
        self._segments: list[_Segment] = []
        for gi, p, start, end in self._ranges(owned):
            view = local_flat(p)[start:end]
            if host and device.type == "cpu" and view.dtype == torch.float32:
                # a CPU device's memory is the host's: the fp32 shard is its own master, and its
                # gradient its own host gradient; copies there and back would only cost time
                self._segments.append(_Segment(p, gi, start, end, nn.Parameter(view), None, alias=True))
                continue
            if host:
                if pin:  # page-locked (asynchronous copies), exactly its bytes as counted
                    master = nn.Parameter(pinned(view.shape, torch.float32).copy_(view))
                    host_grad = pinned(view.shape, torch.float32)
                else:
                    master = nn.Parameter(view.to("cpu", torch.float32, copy=True))
                    host_grad = torch.empty_like(master)
            else:
                master, host_grad = nn.Parameter(view), None  # aliases the parameter's storage
            self._segments.append(_Segment(p, gi, start, end, master, host_grad))
        # buckets pipeline the copies to and from a device; on a CPU device there is nothing to
        # overlap, and one inner optimizer steps every segment in one fused call
        self._buckets = self._make_buckets(bucket_numel if host and device.type != "cpu" else None)
        on_host = host or device.type == "cpu"  # a CPU device's step is a host step too
        self._threads = host_threads(local_world_size) if on_host else torch.get_num_threads()
        # the DeepSpeed kernel of host_kernel="deepspeed" (None: the inner optimizers' own step)
        self._kernel = host_kernel(optimizer, kernel, on_host=on_host, device=device)
        self._fused = False  # the inner optimizers run torch's fused kernel (set by _build_inner)
        self._user_groups: list[list[int]] = []  # per inner optimizer: the user's group of each of its groups
        self._inner = [self._build_inner(bucket) for bucket in self._buckets]
        optimizer.state.clear()  # its state now lives, sliced, in the inner optimizers
        self._copy_stream = torch.cuda.Stream(device) if pin else None

    # -- construction -------------------------------------------------------------------------
    def _ranges(self, owned: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor, int, int]]:
        if self.partition == "local":
            return [(gi, p, 0, local_flat(p).numel()) for gi, p in owned if local_flat(p).numel()]
        group_of = {id(p): gi for gi, p in owned}
        ranges = []
        for space in self._spaces:
            lo, hi = space.ranks.rank * space.chunk, (space.ranks.rank + 1) * space.chunk
            for p, off in space.params:
                a, b = max(lo, off), min(hi, off + _numel(p))
                if a < b:
                    ranges.append((group_of[id(p)], p, a - off, b - off))
        return ranges

    def _make_buckets(self, bucket_numel: int | None) -> list[list[_Segment]]:
        if bucket_numel is None:
            return [self._segments] if self._segments else []
        buckets: list[list[_Segment]] = []
        size = bucket_numel
        for seg in self._segments:
            if size >= bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].append(seg)
            size += seg.end - seg.start
        return buckets

    def _build_inner(self, bucket: list[_Segment]) -> torch.optim.Optimizer:
        groups: list[dict[str, Any]] = []
        self_map: list[int] = []
        for gi, user_group in enumerate(self.optimizer.param_groups):
            masters = [s.master for s in bucket if s.group == gi]
            if masters:
                groups.append({**_hyper(user_group), "params": masters})
                self_map.append(gi)
        cls: Any = type(self.optimizer)  # a torch.optim.Optimizer subclass, constructed as users do
        try:
            inner = cls(groups, **self.optimizer.defaults)
        except TypeError:  # `defaults` holds keys the constructor does not take
            inner = cls(groups)
        if (self.host or self.device.type == "cpu") and self._kernel is None:
            # host masters: torch's fused CPU kernel where it has one
            self._fused = use_fused(inner, quiet=not self.host)
        self._user_groups.append(self_map)
        for seg in bucket:  # carry over state the user's optimizer already had, sliced
            old = self.optimizer.state.get(seg.param)
            if old:
                inner.state[seg.master] = {k: self._slice_state(v, seg) for k, v in old.items()}
        return cast(torch.optim.Optimizer, inner)

    def _slice_state(self, value: Any, seg: _Segment) -> Any:
        if not torch.is_tensor(value):
            return value
        flat = local_flat(value)
        if flat.numel() == local_flat(seg.param).numel():
            return flat[seg.start : seg.end].to(seg.master.device, torch.float32, copy=True)
        return value.detach().clone()  # scalars such as Adam's `step`

    # -- the step ---------------------------------------------------------------------------
    def _sync_hyperparams(self) -> None:
        for inner, user_groups in zip(self._inner, self._user_groups, strict=True):
            for group, gi in zip(inner.param_groups, user_groups, strict=True):
                # hyperparameters follow the user's groups (schedulers); how it steps stays ours
                group.update({k: v for k, v in _hyper(self.optimizer.param_groups[gi]).items()
                              if not (self._fused and k in IMPLEMENTATION_KEYS)})

    @torch.no_grad()
    def step(self) -> None:
        self._sync_hyperparams()
        if self.host:
            self._host_step()
        else:
            for seg in self._segments:
                g = seg.param.grad
                seg.master.grad = None if g is None else local_flat(g)[seg.start : seg.end]
            with threads(self._threads):
                for inner in self._inner:
                    self._step_inner(inner)
            for seg in self._segments:
                seg.master.grad = None  # drop the alias, or zero_grad could not free the grad
        if self.partition == "flat":
            self._all_gather_params()
        mark_stepped(self.optimizer)  # LR-scheduler bookkeeping

    def _host_step(self) -> None:
        stream = self._copy_stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # gradients are ready
        landed = []
        with ctx:  # queue every device->host gradient copy at once
            for bucket in self._buckets:
                for seg in bucket:
                    g = seg.param.grad
                    if seg.alias:
                        seg.master.grad = None if g is None else local_flat(g)[seg.start : seg.end]
                        continue
                    seg.master.grad = None if g is None else seg.host_grad
                    if g is not None and seg.host_grad is not None:
                        seg.host_grad.copy_(local_flat(g)[seg.start : seg.end], non_blocking=True)
                landed.append(stream.record_event() if stream is not None else None)
        for inner, bucket, event in zip(self._inner, self._buckets, landed):
            if event is not None:
                event.synchronize()  # this bucket's gradients are on the host
            with threads(self._threads):
                self._step_inner(inner)  # host compute, overlapping the copies of the other buckets
            with ctx:
                for seg in bucket:
                    if seg.alias:
                        seg.master.grad = None  # drop the alias, or zero_grad could not free the grad
                    else:
                        local_flat(seg.param)[seg.start : seg.end].copy_(seg.master, non_blocking=True)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _step_inner(self, inner: torch.optim.Optimizer) -> None:
        if self._kernel is not None:
            self._kernel.step(inner)
        else:
            inner.step()

    def _all_gather_params(self) -> None:
        """Give every rank the ranges the others updated (zero1): one all-gather per space (a
        space this rank holds alone, or with no other rank, it updated whole)."""
        for space in self._spaces:
            if space.ranks.world == 1:
                continue
            lo = space.ranks.rank * space.chunk
            # in place: this rank's range is written straight into its slot of the gathered buffer
            # (gloo and NCCL both accept an input that is the output's own slice), no second buffer
            full = torch.empty(space.chunk * space.ranks.world, dtype=space.dtype, device=self.device)
            mine = full[lo : lo + space.chunk]
            for p, off in space.params:
                a, b = max(lo, off), min(lo + space.chunk, off + _numel(p))
                if a < b:
                    mine[a - lo : b - lo].copy_(local_flat(p)[a - off : b - off])
            total = space.params[-1][1] + _numel(space.params[-1][0])
            if lo + space.chunk > total:  # the last rank's padding: defined bytes, never read back
                mine[max(0, total - lo) :].zero_()
            _all_gather_flat(full, mine, group=space.ranks.group)
            for p, off in space.params:
                local_flat(p).copy_(full[off : off + _numel(p)])

    # -- checkpoints ------------------------------------------------------------------------
    def _init_state(self) -> None:
        """Create the inner optimizers' state if it is missing (`zero_step`)."""
        for inner in self._inner:
            if not inner.state:
                zero_step(inner, [g["params"] for g in inner.param_groups])

    def _keys(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Per-element state keys, and scalar state (the same for every parameter)."""
        self._init_state()
        for inner in self._inner:
            for master, st in inner.state.items():
                elem = [k for k, v in st.items()
                        if torch.is_tensor(v) and v.numel() == master.numel() and v.dim() > 0]
                scalars = {k: v for k, v in st.items() if k not in elem}
                return elem, scalars
        return [], {}

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        names = _names(model)
        elem, scalars = self._keys()
        state: dict[str, dict[str, Any]] = {}
        if self.partition == "local":
            # zero-copy: each state shard, seen as a DTensor laid out like its parameter, where
            # it lives (offloaded: the host; DCP reads and loads it there, never via the GPU)
            for seg in self._segments:
                st = self._state_of(seg)
                param = seg.param
                assert isinstance(param, DTensor)  # partition "local": FSDP2 shards
                state[names[id(param)]] = {
                    **{k: _clone(v) for k, v in scalars.items()},
                    **{k: _like(st[k], param) for k in elem},
                }
        else:
            # zero1: whole tensors; each rank contributes its ranges, one all-reduce per key
            for space in self._spaces:
                for key in elem:
                    full = self._gather_space(space, key)
                    for p, off in space.params:
                        entry = state.setdefault(names[id(p)], {k: _clone(v) for k, v in scalars.items()})
                        entry[key] = _like(full[off : off + _numel(p)], p)
        groups = [
            {**_hyper(g), "params": [names[id(p)] for p in g["params"]]} for g in self.optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def _state_of(self, seg: _Segment) -> dict[str, Any]:
        for inner in self._inner:
            if seg.master in inner.state:
                return cast(dict[str, Any], inner.state[seg.master])  # the live dict: loading writes into it
        raise KeyError("segment without optimizer state")

    def _gather_space(self, space: _FlatSpace, key: str) -> torch.Tensor:
        # offloaded state is gathered where it lives (the host: gloo beside NCCL), not on the GPU;
        # on a group with no CPU backend (a script's pure-NCCL group) it must go through the device
        where = host_device(self.device, space.ranks.group) if self.host else self.device
        full = torch.zeros(space.chunk * space.ranks.world, dtype=torch.float32, device=where)
        offsets = {id(p): off for p, off in space.params}
        for seg in self._segments:
            if id(seg.param) in offsets:
                a = offsets[id(seg.param)] + seg.start
                full[a : a + seg.end - seg.start].copy_(self._state_of(seg)[key])
        if space.ranks.world > 1:  # ranges are disjoint: the sum is the concatenation
            dist.all_reduce(full, group=space.ranks.group)
        return full

    @torch.no_grad()
    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        names = _names(model)
        for seg in self._segments:
            saved = state["state"][names[id(seg.param)]]
            st = self._state_of(seg)
            for k, v in saved.items():
                if self.partition == "local" and isinstance(v, DTensor):
                    if local_tensor(v).data_ptr() != st[k].data_ptr():
                        st[k].copy_(local_tensor(v).reshape(-1))
                elif torch.is_tensor(v) and v.dim() > 0:
                    st[k].copy_(local_flat(v)[seg.start : seg.end])
                else:
                    st[k] = _clone(v)
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.reload_params()  # the host masters follow the parameters the checkpoint just restored

    @torch.no_grad()
    def reload_params(self) -> None:
        if self.host:
            for seg in self._segments:
                if not seg.alias:
                    seg.master.data.copy_(local_flat(seg.param)[seg.start : seg.end])

    # -- bookkeeping ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "inner": [o.state_dict() for o in self._inner]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for inner, sd in zip(self._inner, state["inner"], strict=True):
            inner.load_state_dict(sd)

    def tensors(self) -> list[torch.Tensor]:
        out = [v for o in self._inner for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
        if self.host:
            out += [s.master for s in self._segments]
            out += [s.host_grad for s in self._segments if s.host_grad is not None]
        return out


# torch 2.13 renamed all_gather_into_tensor; older releases (down to 2.6) only have the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _names(model: nn.Module) -> dict[int, str]:
    """Parameter -> its name in the user's module (without DDP's `module.` prefix)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return {id(p): n for n, p in model.named_parameters()}


def _clone(v: Any) -> Any:
    return v.detach().clone() if torch.is_tensor(v) else v


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
