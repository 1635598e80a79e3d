"""Host memory to build and load a model, per process and strategy (no trace needed).

Building a model normally puts all of it in every process's host memory before `prepare` shards
it. Built under `engine.init_empty()` and filled by `prepare` (initializers, or `from_pretrained`
/ `load_model`), a process holds in host memory:
  - the parameters that live on the host: its shards (zero2/zero3) or the whole model
    (ddp/zero1) on CPU processes, its shards with zero3 + parameter offload on GPUs, none
    otherwise (they go to the GPU);
  - plus one module's own tensors at full size, where initializers run (`materialize`), or the
    rows of one tensor being read (`load_model`), whichever is larger.
Buffers stay whole on every process. Optimizer offload allocates its host masters later, at the
optimizer's `prepare`, and is not part of this figure (the step's plan counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .fakes import fake_mode
from .presets import ModelSpec
from .trace import Candidate


@dataclass(frozen=True, slots=True)
class LoadMemory:
    """Predicted peak host bytes per process while the model is built and loaded."""

    whole: float
    """every process builds the whole model (a normal build, or from_pretrained without shardwise)"""
    init: dict[Candidate, float]
    """built under init_empty and initialized at prepare, per candidate"""
    load: dict[Candidate, float]
    """built empty and loaded at prepare (engine.from_pretrained), per candidate"""
    parameters: float
    """the model's parameter bytes"""
    largest_module: float
    """the largest single module's own tensors (one initializer's working set)"""


def _bytes(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _sharded_at_rest(c: Candidate) -> bool:
    """Each process keeps only its shard of the parameters between steps: the stages that shard
    gradients run on FSDP2 on the torch backend, which shards the parameters too (zero2 only
    keeps them gathered from forward to backward)."""
    return c.strategy_spec.shards_grads


def load_memory(source: ModelSpec | nn.Module, candidates: list[Candidate], *, world_size: int,
                device: str) -> LoadMemory:
    """`LoadMemory` for a model at its full depth: `source` built on fake tensors (no memory), or
    the fake-tensor build the planner already made."""
    if isinstance(source, nn.Module):
        model = source
    else:
        with fake_mode():
            model = source.build(None)
    params = _bytes(list({id(p): p for p in model.parameters()}.values()))
    buffers = _bytes(list(model.buffers()))
    largest = 0.0
    for m in model.modules():
        owners = [m] + (list(m.children()) if m._parameters else [])
        own = [t for o in owners for t in [*o._parameters.values(), *o._buffers.values()] if t is not None]
        largest = max(largest, _bytes(own))
    biggest_tensor = max((_bytes([p]) for p in model.parameters()), default=0.0)
    init, load = {}, {}
    for c in candidates:
        sharded = _sharded_at_rest(c)
        world = c.sharding_group(world_size)  # hybrid: cut within the sharding group only
        on_host = device == "cpu" or c.offload_spec.params_on_host
        resident = (params / world if sharded else params) if on_host else 0.0
        init[c] = resident + largest + buffers
        load[c] = resident + (biggest_tensor / world if sharded else biggest_tensor) + buffers
    return LoadMemory(whole=params + buffers, init=init, load=load, parameters=params, largest_module=largest)
