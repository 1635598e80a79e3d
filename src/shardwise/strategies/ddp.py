"""ddp and zero1: full parameter replicas, gradients all-reduced by DistributedDataParallel.

ddp keeps the optimizer whole on every rank. zero1 keeps DDP's bucketed, backward-overlapped
all-reduce and shards only the optimizer: each rank updates 1/W of the elements and an
all-gather redistributes them (see `sharded_optim`). With offload='optimizer' those 1/W live
and step on the host.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import EngineConfig, offload_spec
from ..dist import DistInfo
from .base import EmptyModel, OptimizerRunner, Strategy
from .frozen import for_inference
from .sharded_optim import optimizer_runner


class DDPStrategy(Strategy):
    """Replicated model; `shard_optimizer` turns ddp into zero1."""

    def __init__(self, cfg: EngineConfig, info: DistInfo, *, shard_optimizer: bool) -> None:
        super().__init__(cfg, info)
        self.shard_optimizer = shard_optimizer

    def setup_model(self, model: nn.Module, empty: EmptyModel | None = None) -> nn.Module:
        if for_inference(model):  # a frozen reference: nothing to all-reduce, no DDP wrapper
            return self.replicate(model, empty)
        if empty is not None:  # replicas: every process holds the whole model anyway
            self.fill(model, empty, self.info.device)
        model.to(self.info.device)
        device_ids = [self.info.device.index] if self.info.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here, so every replica starts equal.
        return DistributedDataParallel(model, device_ids=device_ids)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def make_runner(self, optimizer: torch.optim.Optimizer) -> OptimizerRunner:
        if not self.shard_optimizer:  # ddp: a CPU device's step is a host step (see host_step)
            return optimizer_runner(optimizer, self.cfg, self.info, partition=None)
        # zero1: each rank steps 1/W of the flat elements, on the host with optimizer offload
        return optimizer_runner(optimizer, self.cfg, self.info, partition="flat",
                                host=offload_spec(self.cfg.offload).optimizer_on_host)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if not self.info.is_main:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}
