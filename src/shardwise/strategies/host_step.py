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

`host_kernel="deepspeed"` steps Adam/AdamW with DeepSpeed's CPUAdam op instead (`DeepSpeedAdam`),
on either backend. It writes the optimizer's own state under torch's keys, so the object the
script holds, its checkpoints and its schedulers are the same whichever kernel ran. torch's
kernel is the default because it measured at least as fast on this project's machines
(benchmarks/host_optimizer.py). Both compute Adam's update; they differ in float rounding.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config.tree import HostKernelName as HostKernel
from ..distributed.internals import (
    allow_amp_scaling,
    is_fake,
    local_tensor,
    mark_stepped,
    step_post_hooks,
    step_pre_hooks,
)

log = logging.getLogger("shardwise")

FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
DTENSOR_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)  # DTensor has sharding rules for these only
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")  # how, not what, a group steps
_SAID: set[str] = set()


def fused_overrides(optimizer: torch.optim.Optimizer, *, dtensors: bool = False,
                    quiet: bool = False) -> dict[str, Any]:
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
    if _traced(optimizer):
        # the planner's fake-tensor trace: fused CPU kernels have no fake implementation (torch
        # would run them on real tensors of the full size), and they hold no more state than the loop
        return False
    extra = fused_overrides(optimizer, dtensors=dtensors, quiet=quiet)
    if not extra:
        return False
    for group in optimizer.param_groups:
        group.update(extra)
    optimizer.defaults.update(extra)
    allow_amp_scaling(optimizer)
    return True


def _traced(optimizer: torch.optim.Optimizer) -> bool:
    """`optimizer` holds fake (or meta) tensors: the planner's trace, where no kernel runs."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    return first is not None and (is_fake(first) or first.device.type == "meta")


def host_threads(local_world_size: int) -> int:
    """The CPUs this process may use for the host step: its affinity mask, shared among the
    processes of this machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_world_size))


def step_on_host(optimizer: torch.optim.Optimizer, device: torch.device, local_world_size: int, *,
                 offloaded: bool, dtensors: bool = False,
                 kernel: HostKernel = "torch") -> tuple[int | None, DeepSpeedAdam | None]:
    """For a runner that steps `optimizer` in place: where its parameters live on the host
    (offloaded, or a CPU device), the threads its step gets and, for host_kernel="deepspeed",
    the kernel that steps it; otherwise switch it to torch's fused kernel. (None, None) elsewhere:
    a GPU's step keeps the optimizer as the user made it."""
    on_host = offloaded or device.type == "cpu"
    kernel_ = host_kernel(optimizer, kernel, on_host=on_host, device=device)
    if not on_host:
        return None, None
    if kernel_ is None:
        use_fused(optimizer, dtensors=dtensors, quiet=not offloaded)  # the warning is for offload runs
    return host_threads(local_world_size), kernel_


def host_kernel(optimizer: torch.optim.Optimizer, kernel: HostKernel, *, on_host: bool,
                device: torch.device) -> DeepSpeedAdam | None:
    """The DeepSpeed kernel that steps `optimizer` for host_kernel="deepspeed" (None for torch's
    own step); refused in one line where no step runs on the host."""
    if kernel == "torch":
        return None
    if not on_host:
        raise ValueError(
            f"host_kernel={kernel!r} steps optimizers whose parameters live on the host, and this "
            f"run steps on {device.type} with offload='none': set offload, or host_kernel='torch'"
        )
    return DeepSpeedAdam.for_optimizer(optimizer)


class DeepSpeedAdam:
    """Steps a torch Adam/AdamW over host tensors with DeepSpeed's CPUAdam op (the kernel
    DeepSpeed's own offload swaps in). The same update as torch's, in the optimizer's own state
    under torch's keys (`step` as a float tensor, `exp_avg`, `exp_avg_sq`, each shaped like its
    parameter, a DTensor for a DTensor), so `state_dict`, checkpoints and a later switch back to
    torch's kernel read it unchanged. Sharded (DTensor) tensors are stepped through their local
    shards: the update is elementwise."""

    _ids = itertools.count(0x5A17)

    def __init__(self, op: Any, adamw: bool) -> None:
        self.op = op
        self.id = next(self._ids)
        self.steps = 0  # calls so far (DeepSpeed makes one per param group); tests read it
        # the op keeps per-id settings; every update passes the group's own hyperparameters
        op.create_adam(self.id, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw, False)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.op.destroy_adam(self.id)

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> DeepSpeedAdam | None:
        """The kernel for `optimizer`, or a one-line error naming what rules it out. None for the
        planner's fake-tensor trace (no kernel runs there)."""
        if _traced(optimizer):
            return None
        name = type(optimizer).__name__
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(  # noqa: TRY004 -- a setting rules out this optimizer
                f"host_kernel='deepspeed' steps Adam and AdamW only, and the optimizer is {name}: "
                "use host_kernel='torch'")
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if any(g.get(key) for g in optimizer.param_groups):
                raise ValueError(f"host_kernel='deepspeed' cannot step {name}({key}=True): DeepSpeed's "
                                 "CPUAdam has no such mode; use host_kernel='torch'")
        decoupled = bool(optimizer.defaults.get("decoupled_weight_decay"))
        adamw = isinstance(optimizer, torch.optim.AdamW) or decoupled
        return cls(_cpu_adam_op(), adamw)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One step of every parameter of `optimizer` that has a gradient, as its own `step()`
        would, the optimizer's step hooks included."""
        for pre in step_pre_hooks(optimizer):
            if pre(optimizer, (), {}) is not None:
                raise ValueError("host_kernel='deepspeed': an optimizer step pre-hook that changes the "
                                 "step's arguments is not supported; use host_kernel='torch'")
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = optimizer.state[p]
                if not st:  # torch's layout, so torch's kernel could take over from it
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                self.op.adam_update(self.id, int(st["step"].item()), lr, beta1, beta2, eps, wd, True,
                                    _local(p), _local(p.grad), _local(st["exp_avg"]),
                                    _local(st["exp_avg_sq"]))
        for post in step_post_hooks(optimizer):
            post(optimizer, (), {})
        mark_stepped(optimizer)  # LR-scheduler bookkeeping
        self.steps += 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the op writes: a DTensor's local shard (contiguous, as FSDP2 keeps it)."""
    local = local_tensor(t)
    if not local.is_contiguous() or local.device.type != "cpu" or local.dtype != torch.float32:
        raise ValueError(f"host_kernel='deepspeed' steps contiguous fp32 host tensors; got {local.dtype} on "
                         f"{local.device}: use host_kernel='torch'")
    return local


STALE_BUILD_LOCK_S = 900.0  # a CPUAdam build takes about a minute here; a lock this old is left over


def stale_build_lock(name: str, now: float | None = None) -> Path | None:
    """The `lock` file torch's extension builder keeps in `name`'s build folder while it builds,
    when it is older than `STALE_BUILD_LOCK_S`: left by a build that was killed, it makes every
    later build wait for ever (torch's FileBaton). The folder is torch's: TORCH_EXTENSIONS_DIR/name,
    else <cache>/torch_extensions/<python and device tag>/name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        locks = [Path(root) / name / "lock"]
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        locks = sorted(Path(cache, "torch_extensions").glob(f"*/{name}/lock"))
    now = time.time() if now is None else now
    for lock in locks:
        try:
            if now - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
                return lock
        except OSError:  # (gone meanwhile: a build just ended)
            continue
    return None


def _cpu_adam_op() -> Any:
    """DeepSpeed's CPUAdam op, built on first use (DeepSpeed's JIT build, cached on disk)."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError as e:
        raise ValueError("host_kernel='deepspeed' needs DeepSpeed: pip install 'shardwise[deepspeed]', "
                         f"or host_kernel='torch' ({e})") from None
    lock = stale_build_lock(CPUAdamBuilder.NAME)
    if lock is not None:
        minutes = (time.time() - lock.stat().st_mtime) / 60
        raise ValueError(f"host_kernel='deepspeed': {lock} is a build lock {minutes:.0f} minutes old, left "
                         "by a build of DeepSpeed's CPUAdam op that was stopped (torch would wait for it for "
                         "ever); delete that file, or use host_kernel='torch'")
    try:
        return CPUAdamBuilder().load(verbose=False)
    except (ImportError, OSError, RuntimeError, subprocess.SubprocessError) as e:  # a compiler missing, say
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"host_kernel='deepspeed': DeepSpeed's CPUAdam op did not build or load "
                         f"({type(e).__name__}: {first}); it needs a C++ compiler on the first use. "
                         "Use host_kernel='torch'") from None


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
