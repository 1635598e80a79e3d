"""What `Accelerator` sets up beyond the engine so that Accelerate's own helpers a script calls
keep working: the process state `accelerate.logging.get_logger` reads, Accelerate's
`<logging_dir>/<run>` tracker layout, and `Accelerator.profile()` with `ProfileKwargs`.

accelerate is imported only where it is installed (`accelerate.logging` needs its state there);
without it nothing here imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from ..distributed.world import backends_of

PROFILE_PATTERN = "profile_{}.json"  # Accelerate's PROFILE_PATTERN_NAME: one trace per process
_OURS = "_shardwise_filled"  # marks the PartialState shared state this module wrote


@dataclass
class ProfileKwargs:
    """Accelerate's `ProfileKwargs`, read by its fields (Accelerate's own object is read the same
    way): the arguments of `torch.profiler.profile`, and where `profile()` writes its traces."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


def build_profiler(handler: Any) -> torch.profiler.profile:
    """`torch.profiler.profile` with the handler's settings (as Accelerate's `ProfileKwargs.build`)."""
    names = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
    activities = None
    if handler.activities is not None:
        unknown = [a for a in handler.activities if str(a) not in names]
        if unknown:
            raise ValueError(f"ProfileKwargs(activities={handler.activities!r}): {unknown[0]!r} is not "
                             "one of "
                             f"{list(names)}")
        activities = [names[str(a)] for a in handler.activities]
    schedule = (torch.profiler.schedule(**handler.schedule_option) if handler.schedule_option is not None
                else None)
    return torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=handler.on_trace_ready,
        record_shapes=handler.record_shapes, profile_memory=handler.profile_memory,
        with_stack=handler.with_stack,
        with_flops=handler.with_flops, with_modules=handler.with_modules)


@contextlib.contextmanager
def profile(handler: Any, process_index: int,
            wait_for_everyone: Callable[[], None]) -> Iterator[torch.profiler.profile]:
    """Profile the block on every process; with `output_trace_dir`, each process then writes its
    own Chrome trace `profile_<process_index>.json` there, and all wait for the last one."""
    handler = handler if handler is not None else ProfileKwargs()
    with build_profiler(handler) as profiler:
        yield profiler
    out = getattr(handler, "output_trace_dir", None)
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(out, PROFILE_PATTERN.format(process_index)))
    wait_for_everyone()


def logging_root(pc: Any) -> Path | None:
    """Accelerate's `logging_dir`: ProjectConfiguration's (`pc`), else the project folder; a
    tracker's run `<name>` is the folder `<logging_dir>/<name>` (no `logs/` in between, as
    Accelerate)."""
    folder = getattr(pc, "logging_dir", None) or getattr(pc, "project_dir", None)
    return Path(folder) if folder is not None else None


def _shared_dict(name: str) -> dict[str, Any]:
    """accelerate's private `PartialState._shared_state` / `AcceleratorState._shared_state`: the
    one dict every `PartialState()` (`AcceleratorState()`) adopts (a Borg singleton). The only
    accelerate-private name shardwise touches; checked against accelerate 1.15.0 and 1.16.0."""
    state = getattr(importlib.import_module("accelerate.state"), name)
    return cast(dict[str, Any], state._shared_state)


def _partial_state_shared_dict() -> dict[str, Any]:
    return _shared_dict("PartialState")


def _accelerator_state_shared_dict() -> dict[str, Any]:
    return _shared_dict("AcceleratorState")


def share_process_state(device: torch.device, distributed_type: str, num_processes: int, process_index: int,
                        local_process_index: int, mixed_precision: str = "no") -> None:
    """Fill Accelerate's `PartialState` shared state with where this process sits, so that
    `accelerate.logging.get_logger(...)` loggers (which read `PartialState()`) log on the main
    process only and tag `[RANK r]` with the real rank; and `AcceleratorState`'s, so that
    Accelerate's helpers that read `AcceleratorState()` (`accelerate.utils.set_seed(seed,
    device_specific=True)`, which TRL's GRPOTrainer calls, adds its `process_index`) find it
    built, with no engine plugin (shardwise runs the engine).

    `PartialState()` itself is not called: it would read Accelerate's launcher environment and
    start a process group of its own; nor `AcceleratorState()`, which refuses to be built but
    by Accelerate's `Accelerator`. Their shared dicts are what every instance adopts (Borg
    singletons), so writing the fields they read is enough; a state Accelerate itself built (a
    script that made `PartialState()` or an Accelerate `Accelerator` first) is left alone."""
    if "accelerate" not in sys.modules and importlib.util.find_spec("accelerate") is None:
        return
    shared = _partial_state_shared_dict()
    types = importlib.import_module("accelerate.utils").DistributedType
    if not shared or shared.get(_OURS):
        shared.clear()
        shared.update({
            _OURS: True,
            "_cpu": device.type == "cpu",
            # the backend of this run's device (Accelerate's "nccl" on a GPU), not the group's string
            "backend": backends_of().get(device.type) if dist.is_initialized() else None,
            "device": device,
            "debug": False,
            "distributed_type": types(distributed_type),
            "num_processes": num_processes,
            "process_index": process_index,
            "local_process_index": local_process_index,
            "fork_launched": False,
        })
    accelerator = _accelerator_state_shared_dict()
    if accelerator and not accelerator.get(_OURS):
        return
    accelerator.clear()
    # AcceleratorState counts as built while its dict differs from PartialState's (these keys)
    accelerator.update({**shared, _OURS: True, "_mixed_precision": mixed_precision, "dynamo_plugin": None,
                        "deepspeed_plugins": None, "fsdp_plugin": None, "megatron_lm_plugin": None,
                        "torch_tp_plugin": None, "parallelism_config": None, "device_mesh": None})
