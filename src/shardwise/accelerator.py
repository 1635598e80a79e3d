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
  a resumed pass (load_state    does not draw its iterator     draws it again, as Accelerate:
  or skip_first_batches)        seed again: bit-exact with     equals Accelerate's resumed run
                                the uninterrupted run          (not its uninterrupted one)
  a loop's end                  the loader stays "at end"      the loader active before is again
  a tracker run's folder        <project_dir>/logs/<run>       <logging_dir or project_dir>/<run>
  save_state() on one process   -- (a collective)              ddp: a one-process checkpoint all
  alone; a no-grad forward of                                  load; sharded: refused in one line
  a sharded model alone                                        (`accelerate_hooks`), never a hang
Both honour the DataLoader's sampler and generator (`shardwise.data._EpochOrder`).
The Accelerate objects a script passes (DataLoaderConfiguration, ProjectConfiguration,
GradientAccumulationPlugin, kwargs handlers) are read by their fields; accelerate is imported
only where installed, to fill the state its logger reads (`accelerate_extras`). Plugins for other engines (deepspeed_plugin, fsdp_plugin, megatron, dynamo,
tensor parallel) are refused: choose the strategy in shardwise's config instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from . import accelerate_extras as extras
from .accelerate_hooks import SoloForwardCheck, StateHooks, save_together, world_of_one
from .accelerate_types import (
    DataLoaderConfiguration,
    DistributedType,
    GradientState,
    ProjectConfiguration,
    checkpoint_index,
    numbered_checkpoints,
    prune_checkpoints,
)
from .config import ConfigError
from .data import PreparedDataLoader
from .engine import Engine
from .optim import PreparedScheduler
from .strategies.frozen import mark_for_inference

F = TypeVar("F", bound=Callable[..., Any])


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
        # sync_each_batch: every micro-step communicates its gradients (less memory, more traffic)
        self._sync_each_batch = bool(getattr(gradient_accumulation_plugin, "sync_each_batch", False))
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
        self.profile_handler: Any = None
        for handler in kwargs_handlers or []:
            timeout = getattr(handler, "timeout", None)
            if type(handler).__name__ == "InitProcessGroupKwargs" and timeout is not None:
                kwargs["collective_timeout_s"] = timeout.total_seconds()
            elif type(handler).__name__ == "ProfileKwargs":
                self.profile_handler = handler
            else:
                warnings.warn(f"{type(handler).__name__} is not applied by shardwise (its settings are "
                              "Accelerate's and PyTorch DDP's)", stacklevel=2)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        super().__init__(**kwargs)
        self.gradient_state = GradientState(self)
        self.state = AcceleratorState(self)
        self.flag_tensor: torch.Tensor | None = None
        self._outer: dict[int, tuple[Any, bool]] = {}  # loader -> the loader active when its loop began
        if self._sync_each_batch and self.config.backend == "deepspeed":
            raise ConfigError("GradientAccumulationPlugin(sync_each_batch=True): backend='deepspeed' syncs at its "
                              "own accumulation boundary only; drop sync_each_batch or use backend='torch'")
        self._observer.root = extras.logging_root(self)  # Accelerate's <logging_dir>/<run> layout
        extras.share_process_state(self)  # accelerate.logging's loggers read it
        self._auto_saved: list[Path] = []  # automatic checkpoint_<i> this process wrote (total_limit's)
        self._state_hooks = StateHooks()
        self._saves: dict[int, int] = {}  # save_state calls at the current step (arrival keys)

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
        return {**out, "on_end": self._loader_ended, "resume_draws": True}

    def _on_batch(self, loader: PreparedDataLoader, last: bool, batch: Any) -> None:
        if loader is not self._loader:
            self._outer[id(loader)] = (self._loader, self._loader_at_end)
        super()._on_batch(loader, last, batch)

    def _loader_ended(self, loader: PreparedDataLoader) -> None:
        """A loop over `loader` ran to its end: the loader active before it is again, as in
        Accelerate's gradient_state (so a later gather is not cut to this loader's remainder)."""
        self._loader, self._loader_at_end = self._outer.pop(id(loader), (None, False))

    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        out = super().prepare(*objects)
        for obj in out if isinstance(out, tuple) else (out,):
            if isinstance(obj, nn.Module) and isinstance(obj, FSDPModule) and self.num_processes > 1 \
                    and not hasattr(obj, "_shardwise_solo"):
                check = SoloForwardCheck(self.num_processes, self.is_main_process, self.config.collective_timeout_s,
                                         lambda: self.step, self._guard.others_moved_on)  # before FSDP's all-gather
                obj.register_forward_pre_hook(check, prepend=True)
                object.__setattr__(obj, "_shardwise_solo", check)
            if isinstance(obj, PreparedScheduler):
                obj.steps_per_call = 1 if self.split_batches else self.num_processes
                obj.step_with_optimizer = self.step_scheduler_with_optimizer
        return out

    def prepare_model(self, model: nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        """`evaluation_mode=True` (a teacher, a reference): prepared for inference only, as a model
        with no trainable parameter is: sharded under zero3, a replica otherwise, no DDP wrapper,
        and no optimizer may hold it (`shardwise.strategies.frozen`)."""
        if evaluation_mode:
            mark_for_inference(model)
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def prepare_data_loader(self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
        return self.prepare(data_loader)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The prepared loader, whose next pass starts after `num_batches` batches (the position
        is set, not added: a script that computes its resume step itself gets exactly that). As in
        Accelerate, where that pass is a new loader's, it does not advance the loader's epoch."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError("skip_first_batches() takes a DataLoader returned by prepare()")
        dataloader.skip_first_batches(num_batches, detached=True)
        return dataloader

    # -- synchronisation ---------------------------------------------------------------------
    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """As `Engine.accumulate`; with GradientAccumulationPlugin(sync_each_batch=True) every
        micro-step's backward communicates (DDP all-reduces, FSDP2 reduce-scatters into the
        sharded gradients), while the optimizer still steps at the boundary only."""
        if not self._sync_each_batch:
            return super().accumulate(*models)
        self._boundary()
        self.session.step_state.begin_micro_step(self._loader_at_end)
        return contextlib.nullcontext()

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

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[torch.profiler.profile]:
        """Accelerate's profiler with its `ProfileKwargs` (`shardwise.accelerate_extras.profile`)."""
        with extras.profile(self, profile_handler or self.profile_handler) as profiler:
            yield profiler

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

    def clear(self, *objects: Any) -> tuple[Any, ...]:  # Accelerate's alias of `free_memory`
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
                   safe_serialization: bool = True, *, merge_adapters: bool = False) -> None:
        if not safe_serialization:
            raise ConfigError("save_model(safe_serialization=False): shardwise writes safetensors only")
        super().save_model(model, save_directory, max_shard_size, merge_adapters=merge_adapters)

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
    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """`hook(models, weights, output_dir)`, before a save writes (`accelerate_hooks.StateHooks`)."""
        return self._state_hooks.add(self._state_hooks.save, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """`hook(models, input_dir)`, before a load reads; returns a handle with `remove()`."""
        return self._state_hooks.add(self._state_hooks.load, hook)

    def _replicated(self) -> bool:
        """Every process holds the whole model and optimizer state (ddp, or one process)."""
        return self.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    def _save_together(self) -> bool:
        """False when this process alone called save_state (refused where the state is sharded)."""
        return save_together(self._saves, self.step, self.num_processes, self.process_index,
                             self.config.collective_timeout_s, None if self._replicated() else self.distributed_type.value,
                             self._guard.others_moved_on)

    def _checkpoints(self) -> Path:
        return Path(self.project_dir or ".") / "checkpoints"

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, *, keep_last: int | None = None,
                   **save_model_func_kwargs: Any) -> Path:
        """Accelerate's automatic naming, safe for earlier runs' checkpoints: the run owns
        `<project_dir>/checkpoints` (`runlock`); a save never goes into an existing
        `checkpoint_<i>`: a fresh run continues the numbering after the newest one there (where
        Accelerate refuses); `total_limit` removes only checkpoints this process wrote and only
        while they hold nothing but the checkpoint (others stay, with one warning)."""
        from . import runlock

        pc = self.project_configuration
        together = self._save_together()
        alone = contextlib.nullcontext() if together else world_of_one(self)  # ddp: a world-of-one checkpoint
        if output_dir is not None or not getattr(pc, "automatic_checkpoint_naming", False):
            with alone:
                path = super().save_state(output_dir, keep_last=keep_last)
            self._state_hooks.after_save(self.session.models, self.unwrap_model, str(path))
            return path
        root = self._checkpoints()
        runlock.hold(root, self.process_index)
        found = numbered_checkpoints(root)
        start = [max(pc.iteration, checkpoint_index(found[-1]) + 1 if found else 0)]
        if self.num_processes > 1 and together:  # process 0's listing: every process saves to the same folder
            dist.broadcast_object_list(start, src=0)
        if start[0] != pc.iteration and self.is_main_process and not self._auto_saved:
            warnings.warn(f"{root / f'checkpoint_{pc.iteration}'} exists (an earlier run's): this run's "
                          f"checkpoints start at checkpoint_{start[0]}", stacklevel=2)
        pc.iteration = start[0]
        with alone:
            path = super().save_state(root / f"checkpoint_{pc.iteration}")
        self._state_hooks.after_save(self.session.models, self.unwrap_model, str(path))
        pc.iteration += 1
        self._auto_saved.append(path)
        limit = getattr(pc, "total_limit", None)
        if limit and len(self._auto_saved) > limit:
            old, self._auto_saved = self._auto_saved[:-limit], self._auto_saved[-limit:]
            if self.is_main_process:
                prune_checkpoints(old)
        if together:
            self.wait_for_everyone()
        return path

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, **load_model_func_kwargs: Any) -> int | None:
        from . import runlock

        pc = self.project_configuration
        if input_dir is None and getattr(pc, "automatic_checkpoint_naming", False):
            runlock.hold(self._checkpoints(), self.process_index)
            found = numbered_checkpoints(self._checkpoints())
            if not found:
                raise FileNotFoundError(f"no checkpoint_<i> folder under {self._checkpoints()} to load")
            input_dir = found[-1]
            pc.iteration = checkpoint_index(found[-1]) + 1  # the next save does not overwrite it
        if input_dir is not None:
            self._state_hooks.before_load(self.session.models, str(input_dir))
        epochs = [(loader._iteration, loader._epoch) for loader in self._loaders]
        step = super().load_state(input_dir)
        if not getattr(self.dataloader_config, "use_stateful_dataloader", False):
            # Accelerate restores weights, optimizer, schedulers and RNG, not where a DataLoader
            # stood (its epoch, its place in it): its scripts skip the batches themselves
            # (skip_first_batches or a `continue`), and would skip twice if the position came back
            for loader, (iteration, epoch) in zip(self._loaders, epochs):
                loader._resume_at, loader._iteration, loader._epoch = 0, iteration, epoch
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
