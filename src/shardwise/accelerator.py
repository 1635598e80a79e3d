"""`Accelerator`: the `Engine` under Hugging Face Accelerate's names and rules, so a script
written for Accelerate runs with `from shardwise import Accelerator` and gets the same numbers.

Where Accelerate's rules differ from the Engine's, the Accelerator follows Accelerate's:

  rule                          Engine                         Accelerator (= Accelerate)
  LR scheduler steps            once per optimizer step        once per process per optimizer
                                                               step (once with split_batches)
  last incomplete batch         ceil(L/W) per process          a full batch per process
                                                               (even_batches=True; False: as is)
  seeding                       only a given seed              only a given seed (the script's
                                                               set_seed stands)
  save_state() with no folder   <checkpoint_dir>/step_<N>      <project_dir>/checkpoints/
                                                               checkpoint_<i> with
                                                               automatic_checkpoint_naming
  load_state(): the DataLoader  restored                       not restored (scripts skip the
  position within its epoch                                    seen batches themselves), unless
                                                               use_stateful_dataloader=True
Both: a resumed pass does not draw its iterator seed again, so a mid-epoch resume is bit-exact
with dropout (Accelerate draws it again: the one deliberate difference from its numbers).
Both honour the DataLoader's sampler and generator (`shardwise.data._EpochOrder`).
The Accelerate objects a script passes (DataLoaderConfiguration, ProjectConfiguration,
GradientAccumulationPlugin, kwargs handlers) are read by their fields; accelerate itself is
never imported. Plugins for other engines (deepspeed_plugin, fsdp_plugin, megatron, dynamo,
tensor parallel) are refused: choose the strategy in shardwise's config instead.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import ConfigError
from .data import PreparedDataLoader
from .engine import Engine
from .optim import PreparedScheduler

F = TypeVar("F", bound=Callable[..., Any])


class DistributedType(str, enum.Enum):
    """Accelerate's names for how a run is distributed; members compare equal to Accelerate's
    (both are strings)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"


@dataclass
class DataLoaderConfiguration:
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False


@dataclass
class GradientAccumulationPlugin:
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


class GradientState:
    """Accelerate's `gradient_state`, read from the engine's step state."""

    def __init__(self, acc: Accelerator) -> None:
        self._acc = acc

    @property
    def sync_gradients(self) -> bool:
        return self._acc.sync_gradients

    @property
    def num_steps(self) -> int:
        return self._acc.gradient_accumulation_steps

    @property
    def end_of_dataloader(self) -> bool:
        return self._acc._loader_at_end

    @property
    def remainder(self) -> int:
        loader = self._acc._loader
        return loader.remainder() if loader is not None and self._acc._loader_at_end else -1

    @property
    def in_dataloader(self) -> bool:
        return self._acc._loader is not None and not self._acc._loader_at_end

    # Accelerate's GradientState reads adjust_scheduler from the plugin's non-default fields, so
    # with its default (True) it reads False and its scheduler never counts micro-steps: neither
    # does ours, whatever the plugin says
    adjust_scheduler = False
    sync_with_dataloader = True


class AcceleratorState:
    """Accelerate's `state`: where this process sits and how the run is set up."""

    def __init__(self, acc: Accelerator) -> None:
        self._acc = acc

    def __getattr__(self, name: str) -> Any:
        if name in ("num_processes", "process_index", "local_process_index", "device", "distributed_type",
                    "mixed_precision", "is_main_process", "is_local_main_process", "is_last_process",
                    "use_distributed"):
            return getattr(self._acc, name)
        if name in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "dynamo_plugin"):
            return None
        if name == "backend":
            return dist.get_backend() if dist.is_initialized() else None
        raise AttributeError(f"AcceleratorState.{name} is not offered by shardwise")


_REFUSED = ("deepspeed_plugin", "fsdp_plugin", "torch_tp_plugin", "megatron_lm_plugin", "dynamo_backend",
            "dynamo_plugin", "deepspeed_plugins", "parallelism_config")


class Accelerator(Engine):
    """Accelerate's `Accelerator` (its keywords, attributes and rules) on shardwise's engine.
    Keywords Accelerate does not have go to `EngineConfig` as for `Engine`."""

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        rng_types: Any = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        for name in _REFUSED:
            if kwargs.pop(name, None) is not None:
                raise ConfigError(f"Accelerator({name}=...): shardwise does not take Accelerate's plugins for other "
                                  "engines; choose strategy/backend/offload in shardwise's config (`shardwise config`)")
        if not device_placement:
            raise ConfigError("Accelerator(device_placement=False): shardwise places prepared models and batches "
                              "on the process's device; move tensors yourself only outside prepare()")
        if mixed_precision is None:  # Accelerate: from the launcher's config or environment, else "no"
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if mixed_precision is not None:
            kwargs["mixed_precision"] = str(getattr(mixed_precision, "value", mixed_precision))
        if gradient_accumulation_plugin is not None:
            if getattr(gradient_accumulation_plugin, "sync_with_dataloader", True) is False:
                raise ConfigError("GradientAccumulationPlugin(sync_with_dataloader=False): shardwise always ends an "
                                  "accumulation at the end of the DataLoader")
            if gradient_accumulation_steps != 1:
                raise ConfigError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
            gradient_accumulation_steps = int(getattr(gradient_accumulation_plugin, "num_steps", None) or 1)
        if gradient_accumulation_steps != 1:
            kwargs["grad_accum_steps"] = gradient_accumulation_steps
        if cpu:
            kwargs["cpu"] = True
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        pdir = project_dir if project_dir is not None else getattr(self.project_configuration, "project_dir", None)
        if pdir is not None:
            kwargs["project_dir"] = str(pdir)
            self.project_configuration.project_dir = str(pdir)
        if log_with is not None:
            kwargs["log_with"] = log_with
        self.dataloader_config = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
        if split_batches is not None:
            self.dataloader_config.split_batches = split_batches
        if getattr(self.dataloader_config, "dispatch_batches", None):
            raise ConfigError("DataLoaderConfiguration(dispatch_batches=True): shardwise has every process read "
                              "its own share; set dispatch_batches=False")
        for handler in kwargs_handlers or []:
            timeout = getattr(handler, "timeout", None)
            if type(handler).__name__ == "InitProcessGroupKwargs" and timeout is not None:
                kwargs["collective_timeout_s"] = timeout.total_seconds()
            else:
                warnings.warn(f"{type(handler).__name__} is not applied by shardwise (its settings are "
                              "Accelerate's and PyTorch DDP's)", stacklevel=2)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        super().__init__(**kwargs)
        self.gradient_state = GradientState(self)
        self.state = AcceleratorState(self)
        self.flag_tensor: torch.Tensor | None = None

    # -- what Accelerate's scripts read ----------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        if self.num_processes == 1:
            return DistributedType.NO
        if self.config.backend == "deepspeed":
            return DistributedType.DEEPSPEED
        if self.config.strategy == "ddp":
            return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
        return DistributedType.FSDP

    @property
    def mixed_precision(self) -> str:
        return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[self.config.precision]

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def split_batches(self) -> bool:
        return bool(getattr(self.dataloader_config, "split_batches", False))

    @property
    def even_batches(self) -> bool:
        return bool(getattr(self.dataloader_config, "even_batches", True))

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value
        for loader in self._loaders:
            if loader._batches is not None:
                loader.tail = loader._batches.tail = "full" if value else "uneven"

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.grad_accum_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.config.grad_accum_steps = int(value)
        if self._session is not None:
            self._session.step_state.grad_accum_steps = int(value)

    @property
    def project_dir(self) -> str | None:
        return self.config.project_dir

    @property
    def logging_dir(self) -> str:
        return str(self._observer.logging_dir)

    # -- prepare, Accelerate's way --------------------------------------------------------------
    def _loader_options(self) -> dict[str, Any]:
        cfg = self.dataloader_config
        seedable = bool(getattr(cfg, "use_seedable_sampler", False))
        out: dict[str, Any] = {"tail": "full" if getattr(cfg, "even_batches", True) else "uneven",
                               "split_batches": bool(getattr(cfg, "split_batches", False)), "seedable": seedable}
        data_seed = getattr(cfg, "data_seed", None)
        if seedable and data_seed is not None:
            out["seed"] = int(data_seed)
        return out

    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        out = super().prepare(*objects)
        for obj in out if isinstance(out, tuple) else (out,):
            if isinstance(obj, PreparedScheduler):
                obj.steps_per_call = 1 if self.split_batches else self.num_processes
                obj.step_with_optimizer = self.step_scheduler_with_optimizer
        return out

    def prepare_model(self, model: nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def prepare_data_loader(self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
        return self.prepare(data_loader)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The prepared loader, whose next pass starts after `num_batches` batches (the position
        is set, not added: a script that computes its resume step itself gets exactly that)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError("skip_first_batches() takes a DataLoader returned by prepare()")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    # -- synchronisation ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Backward inside communicates nothing; gradients accumulate locally."""
        with self.session.strategy.no_sync(model):
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """The next backward all-reduces even inside an accumulation (DDP; elsewhere a no-op,
        as in Accelerate)."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        old = model.require_backward_grad_sync
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync = old

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Let processes with fewer batches finish (DDP: torch's Join; elsewhere a warning)."""
        before = self.even_batches
        if even_batches is not None:
            self.even_batches = even_batches
        try:
            if self.num_processes > 1 and all(isinstance(j, DistributedDataParallel) for j in joinables):
                from torch.distributed.algorithms.join import Join

                with Join(joinables):
                    yield
            else:
                if self.num_processes > 1:
                    warnings.warn("join_uneven_inputs() joins DDP models only; nothing is joined here", stacklevel=3)
                yield
        finally:
            self.even_batches = before

    def set_trigger(self) -> None:
        """Raise a flag on this process that `check_trigger()` sees on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger()` (then reset)."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        if self.reduce(flag, "sum").item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # -- on which process ------------------------------------------------------------------
    def on_main_process(self, function: F) -> F:
        return self._on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: F) -> F:
        return self._on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: F) -> F:
        return self._on(function, lambda: self.is_last_process)

    def on_process(self, function: Any = None, process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Any = None, local_process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._on(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _on(function: F, here: Callable[[], bool]) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if here() else None

        return wrapper  # type: ignore[return-value]

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of them."""
        n, r = self.num_processes, self.process_index

        def share(x: Any) -> Any:
            if isinstance(x, dict):
                return {k: share(v) for k, v in x.items()}
            per, extra = divmod(len(x), n)
            start = r * per + min(r, extra)
            part = x[start : start + per + (1 if r < extra else 0)]
            if apply_padding and len(part) < per + (1 if extra else 0):
                part = part + part[-1:] if not torch.is_tensor(part) else torch.cat([part, part[-1:]])
            return part

        yield share(inputs)

    # -- odds and ends ---------------------------------------------------------------------
    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad `tensor` along `dim` to the largest size across processes (to gather it)."""
        if not torch.is_tensor(tensor) or self.num_processes == 1 or tensor.ndim == 0:
            return tensor
        size = torch.tensor(tensor.shape[dim], device=self.device)
        top = int(self.reduce(size, "max").item())
        if top == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = top
        out = tensor.new_full(shape, pad_index)
        index = [slice(None)] * tensor.ndim
        index[dim] = slice(top - tensor.shape[dim], top) if pad_first else slice(0, tensor.shape[dim])
        out[tuple(index)] = tensor
        return out

    def clear(self, *objects: Any) -> tuple[Any, ...]:
        """Accelerate's alias of `free_memory`."""
        return self.free_memory(*objects)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """`torch.save` on the main process."""
        if self.is_main_process:
            torch.save(obj, f)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        return super().unwrap_model(model)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        return super().get_state_dict(model)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        if not safe_serialization:
            raise ConfigError("save_model(safe_serialization=False): shardwise writes safetensors only")
        super().save_model(model, save_directory, max_shard_size)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        return super().autocast()

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the duplicates that evened out the last batch; objects that are not
        tensors are gathered as objects (as Accelerate does)."""
        if not use_gather_object and _all_tensors(input_data):
            return super().gather_for_metrics(input_data)
        if self.num_processes == 1:
            return input_data
        parts: list[Any] = [None] * self.num_processes
        with self._guard.timeouts():
            dist.all_gather_object(parts, input_data)
        flat = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        keep = self._real_in_last_batch()
        return flat if keep is None else flat[:keep]

    # -- checkpoints with Accelerate's automatic naming -----------------------------------------
    def _checkpoints(self) -> Path:
        return Path(self.project_dir or ".") / "checkpoints"

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, *, keep_last: int | None = None,
                   **save_model_func_kwargs: Any) -> Path:
        pc = self.project_configuration
        if output_dir is not None or not getattr(pc, "automatic_checkpoint_naming", False):
            return super().save_state(output_dir, keep_last=keep_last)
        root = self._checkpoints()
        path = super().save_state(root / f"checkpoint_{pc.iteration}")
        pc.iteration += 1
        limit = getattr(pc, "total_limit", None)
        if limit and self.is_main_process:  # Accelerate's total_limit: keep the newest
            for old in _numbered(root)[: -limit]:
                shutil.rmtree(old, ignore_errors=True)
        self.wait_for_everyone()
        return path

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, **load_model_func_kwargs: Any) -> int | None:
        pc = self.project_configuration
        if input_dir is None and getattr(pc, "automatic_checkpoint_naming", False):
            found = _numbered(self._checkpoints())
            if not found:
                raise FileNotFoundError(f"no checkpoint_<i> folder under {self._checkpoints()} to load")
            input_dir = found[-1]
            pc.iteration = int(found[-1].name.split("_")[1]) + 1  # the next save does not overwrite it
        step = super().load_state(input_dir)
        if not getattr(self.dataloader_config, "use_stateful_dataloader", False):
            # Accelerate restores weights, optimizer, schedulers and RNG, not where a DataLoader
            # stood in its epoch: its scripts skip the batches themselves (skip_first_batches or
            # a `continue`), and would skip twice if the position came back too
            for loader in self._loaders:
                loader._resume_at = 0
                if loader._batches is not None:
                    loader._batches.order.resume = None
        return step


def _all_tensors(data: Any) -> bool:
    if torch.is_tensor(data):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_all_tensors(v) for v in data)
    return False


def _numbered(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
    return [p for _, p in sorted(found)]
