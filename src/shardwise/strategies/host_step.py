"""The host optimizer step of CPU offload at the speed of the hardware.

Offload steps fp32 masters on the host, and that step is most of an offload run's step time. An
optimizer as users write it (`AdamW(params)`) runs torch's single-tensor loop on CPU tensors:
about 9x slower than DeepSpeed's CPUAdam on this machine (benchmarks/host_optimizer.py). torch
has fused CPU kernels for Adam, AdamW, SGD and Adagrad that match it, so the host step runs the
user's class with `fused=True` (same update, rounded within the equivalence tolerances), over
every CPU this process may use (its affinity mask shared among the local processes) instead of
the one thread torchrun gives each worker. A class without a fused kernel keeps its own path,
with one log line saying so.

On a CPU device every optimizer step is a host step, offload or not: there the strategies use
the same kernels (quietly: the warning is for offload runs), so a step over many small sharded
(DTensor) parameters costs a few fused calls instead of a Python loop of dispatches per tensor.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("shardwise")

FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
DTENSOR_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)  # DTensor has sharding rules for these only
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")  # how, not what, a group steps
_SAID: set[str] = set()


def fused_overrides(optimizer: torch.optim.Optimizer, *, dtensors: bool = False, quiet: bool = False) -> dict[str, Any]:
    """The group settings that select the fused CPU kernel for `optimizer`'s class ({} when it
    has none, or when the user's settings rule it out: differentiable, capturable). `dtensors`:
    the parameters are DTensor shards, whose dispatch knows fused Adam and AdamW only."""
    d = optimizer.defaults
    classes = DTENSOR_FUSED_CLASSES if dtensors else FUSED_CLASSES
    if isinstance(optimizer, classes) and not d.get("differentiable") and not d.get("capturable"):
        return {"fused": True, "foreach": None}
    name = type(optimizer).__name__
    if not quiet and name not in _SAID:
        _SAID.add(name)
        log.warning("host step: %s has no fused CPU kernel in torch%s; it runs its own loop (slower)", name,
                    " for sharded (DTensor) parameters" if dtensors else "")
    return {}


def use_fused(optimizer: torch.optim.Optimizer, *, dtensors: bool = False, quiet: bool = False) -> bool:
    """Switch `optimizer`'s groups to the fused kernel where it has one."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    if first is not None and _is_fake(first):
        # the planner's fake-tensor trace: fused CPU kernels have no fake implementation (torch
        # would run them on real tensors of the full size), and they hold no more state than the loop
        return False
    extra = fused_overrides(optimizer, dtensors=dtensors, quiet=quiet)
    if not extra:
        return False
    for group in optimizer.param_groups:
        group.update(extra)
    optimizer.defaults.update(extra)
    if hasattr(optimizer, "_step_supports_amp_scaling"):
        optimizer._step_supports_amp_scaling = True
    return True


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t)) or t.device.type == "meta"


def host_threads(local_world_size: int) -> int:
    """The CPUs this process may use for the host step: its affinity mask, shared among the
    processes of this machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_world_size))


def step_on_host(optimizer: torch.optim.Optimizer, device: torch.device, local_world_size: int, *,
                 offloaded: bool, dtensors: bool = False) -> int | None:
    """For a runner that steps `optimizer` in place: where its parameters live on the host
    (offloaded, or a CPU device), switch it to the fused kernel and return the threads its step
    gets; None elsewhere (a GPU's step keeps the optimizer as the user made it)."""
    if not offloaded and device.type != "cpu":
        return None
    use_fused(optimizer, dtensors=dtensors, quiet=not offloaded)  # the warning is for offload runs
    return host_threads(local_world_size)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block (restored after); None: unchanged."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
