"""ddp and zero1: full parameter replicas, gradients all-reduced by DistributedDataParallel.

ddp keeps the optimizer whole on every rank. zero1 keeps DDP's bucketed, backward-overlapped
all-reduce and shards only the optimizer: each rank updates 1/W of the elements and an
all-gather redistributes them (see `sharded_optim`). With offload='optimizer' those 1/W live
and step on the host.

Hybrid zero1 (`shard_group_size` G < W): gradients are still all-reduced over all W processes
(DDP), then each rank updates 1/G of the elements and the all-gather runs within its group of G
(the groups update the same elements identically), so optimizer state is 1/G per rank and no
parameter bytes cross between groups. ddp shards nothing and ignores `shard_group_size` (said
once, in a log line).

zero1 with expert parallelism: DDP leaves the split experts out (they are DTensors, each rank's
own experts); the ranks holding the same experts sum their gradients (`expert_parallel`) and
split those experts' optimizer steps among themselves, the ranks of the sharding group the rest.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..config.tree import EngineConfig, offload_spec
from ..distributed.internals import ddp_ignore
from ..distributed.world import DistInfo
from .base import EmptyModel, OptimizerRunner, Strategy
from .expert_parallel import experts_held_whole, gradient_sync, sum_over_replicas
from .frozen import for_inference
from .fsdp import sync_generate
from .sharded_optim import Ranks, optimizer_runner

log = logging.getLogger("shardwise")


@functools.cache
def _say_ignored(value: int | str) -> None:
    """One log line per process and value (free_memory builds the strategy again)."""
    log.warning("shard_group_size=%r is ignored: ddp shards nothing (every process keeps the whole model "
                "and optimizer)", value)


def _generate_in_step(model: nn.Module) -> nn.Module:
    """A replica whose forward is collective (its experts or layers split over processes: each
    forward dispatches tokens or gathers activations) generates in step on every process
    (`fsdp.sync_generate`: a process whose sequences end first keeps calling forward)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        sync_generate(model, lambda: None)
    return model


class DDPStrategy(Strategy):
    """Replicated model; `shard_optimizer` turns ddp into zero1."""

    def __init__(self, cfg: EngineConfig, info: DistInfo, *, shard_optimizer: bool) -> None:
        super().__init__(cfg, info, shards=shard_optimizer)
        self.shard_optimizer = shard_optimizer
        self._experts: dict[int, Ranks] = {}  # zero1's split experts (by id): the ranks stepping them
        if shard_optimizer:  # zero1: the mesh whose shard group splits the optimizer state
            self.mesh = self.dims.mesh
        else:  # ddp: every process is a replica (a shard_group_size is ignored, in one log line)
            self.shard_group_size = info.world_size
            if cfg.sharding.shard_group_size is not None and info.is_main:
                _say_ignored(cfg.sharding.shard_group_size)

    def setup_model(self, model: nn.Module, empty: EmptyModel | None = None) -> nn.Module:
        if for_inference(model):  # a frozen reference: nothing to all-reduce, no DDP wrapper
            return _generate_in_step(self.replicate(model, empty))
        if empty is not None:  # replicas: every process holds the whole model anyway
            self.fill(model, empty, self.info.device)
        model.to(self.info.device)
        device_ids = [self.info.device.index] if self.info.device.type == "cuda" else None
        experts = experts_held_whole(model, self.dims)
        if experts:  # (each rank's own experts: DDP must neither broadcast nor all-reduce them)
            names = [n for n, p in model.named_parameters() if id(p) in experts]
            ddp_ignore(model, names)
            self._experts.update({k: Ranks.alone() if g is None else Ranks.of(g) for k, g in experts.items()})
        # DDP broadcasts rank 0's parameters and buffers here, so every replica starts equal.
        # gradient_as_bucket_view: each gradient is a view of its all-reduce bucket, so the
        # reduced bucket is not copied back into separate gradients (a copy of every gradient,
        # each step) and the gradients take no memory beside the buckets
        wrapped = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        sum_over_replicas(model)  # (the experts' other holders, once the model is laid out)
        _generate_in_step(model)
        if callable(getattr(model, "generate", None)):  # (the prepared model's generate: the model's own)
            wrapped.__dict__["generate"] = model.generate
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        gradient_sync(model.module, False)  # (the split experts' holders, which DDP leaves alone)
        try:
            with model.no_sync():
                yield
        finally:
            gradient_sync(model.module, True)

    def make_runner(self, optimizer: torch.optim.Optimizer) -> OptimizerRunner:
        if not self.shard_optimizer:  # ddp: a CPU device's step is a host step (see host_step)
            return optimizer_runner(optimizer, self.cfg, self.info, partition=None)
        # zero1: each rank steps 1/W of the flat elements, on the host with optimizer offload
        # (hybrid: 1/G within the shard group; gradients were all-reduced over every process)
        shard, replicate = self.process_groups()
        return optimizer_runner(optimizer, self.cfg, self.info, partition="flat",
                                host=offload_spec(self.cfg.sharding.offload).optimizer_on_host,
                                group=shard if replicate is not None else None, apart=self._experts)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = self.unwrap(model).state_dict()
        # the split experts whole (a collective: every rank sends its own)
        split = {k: v.full_tensor() for k, v in state.items() if isinstance(v, DTensor)}
        if not self.info.is_main:
            return {}
        return {k: split.get(k, v).detach().to("cpu", copy=True) for k, v in state.items()}
