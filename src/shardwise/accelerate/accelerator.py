"""`Accelerator`: the `Engine` under Hugging Face Accelerate's names and rules, so a script
written for Accelerate runs with `from shardwise import Accelerator` and gets the same numbers.

It composes an `Engine` (`accelerator.engine`) and hands it Accelerate's rules (`LoopRules`
from `accelerate.rules`, one field per difference; the table is in docs/api.md): the LR scheduler
steps once per process per optimizer step, a full last batch per process (even_batches), a
resumed pass draws its iterator seed again, `load_state` leaves DataLoader positions (unless
use_stateful_dataloader), a loop's end makes the loader active before it active again,
sync_each_batch. The Accelerator itself adds Accelerate's checkpoint naming
(`<project_dir>/checkpoints/checkpoint_<i>`), its tracker folders (`<logging_dir>/<run>`), and
calls made on one process alone (`accelerate.hooks`: ddp saves a one-process checkpoint, a
sharded state refuses in one line, never a hang).
The Accelerate objects a script passes (DataLoaderConfiguration, ProjectConfiguration,
GradientAccumulationPlugin, kwargs handlers) are read by their fields; accelerate is imported
only where installed, to fill the state its logger reads (`accelerate.extras`). dynamo_backend
and dynamo_plugin become `compile: true` (each block compiled, `strategies.compile`). Plugins for
other engines (deepspeed_plugin, fsdp_plugin, megatron, tensor parallel) are refused: choose the
strategy in shardwise's config instead.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..checkpoint import runlock
from ..checkpoint.naming import NumberedFolders, prune_checkpoints
from ..checkpoint.sharded import rng_state, save_rng_after_hooks
from ..config.tree import ConfigError, EngineConfig
from ..distributed.internals import flatten_mesh, holds_partitions
from ..engine.data import PreparedDataLoader
from ..engine.engine import Engine
from ..engine.loop_rules import LoopRules
from ..engine.optim import PreparedOptimizer, PreparedScheduler
from ..engine.session import Session
from ..runtime.memory import MemoryReport
from ..strategies.frozen import mark_for_inference
from ..weights.adapters import full_weights_held
from . import extras
from .hooks import SoloForwardCheck, StateHooks, save_together, world_of_one
from .objects import (
    AcceleratorState,
    DataLoaderConfiguration,
    DistributedType,
    GradientState,
    ParallelSizes,
    ProjectConfiguration,
)
from .plugins import announce, check_config_file, env_flag, launcher_dynamo, read_plugins
from .process import ProcessHelpers, all_tensors, join_uneven_inputs, trigger_sync_in_backward
from .rules import (
    accelerate_rules,
    accumulation_steps,
    check_rules,
    distributed_type,
    read_dynamo,
    read_handlers,
    read_parallelism,
    refuse_unsupported,
)


class Accelerator(ProcessHelpers):
    """Accelerate's `Accelerator` (its keywords, attributes and rules) on shardwise's engine
    (`self.engine`, an `Engine` following `accelerate.rules`). Keywords Accelerate does not have go
    to `EngineConfig` as for `Engine`."""

    engine: Engine

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
        refuse_unsupported(kwargs, device_placement=device_placement)
        # Accelerate's launcher variables, read where Accelerate reads them (`accelerate.plugins`)
        cpu = cpu or env_flag("ACCELERATE_USE_CPU")
        if gradient_accumulation_plugin is None and gradient_accumulation_steps == 1:
            gradient_accumulation_steps = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1"))
        launcher_dynamo(kwargs)
        read_dynamo(kwargs)  # dynamo_backend / dynamo_plugin: compile each block
        # Accelerate's plugins (and its launcher's variables): translated as their file forms are
        self.plugin_settings, plugin_source = read_plugins(kwargs)
        check_config_file(self.plugin_settings, plugin_source)
        asked_layout = kwargs.get("parallelism_config") is not None or "parallelism" in kwargs
        read_parallelism(kwargs, int(os.environ.get("WORLD_SIZE", "1")))
        if mixed_precision is None:  # Accelerate: from the launcher's config or environment, else "no"
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if mixed_precision is not None:
            kwargs["mixed_precision"] = str(getattr(mixed_precision, "value", mixed_precision))
        gradient_accumulation_steps = accumulation_steps(gradient_accumulation_steps,
                                                         gradient_accumulation_plugin)
        self._plugin = gradient_accumulation_plugin  # its sync_each_batch is a rule (`LoopRules`)
        if gradient_accumulation_steps != 1:
            kwargs["grad_accum_steps"] = gradient_accumulation_steps
        if cpu:
            kwargs["cpu"] = True
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        pdir = project_dir if project_dir is not None else getattr(self.project_configuration,
                                                                   "project_dir", None)
        if pdir is not None:
            kwargs["project_dir"] = str(pdir)
            self.project_configuration.project_dir = str(pdir)
        if log_with is not None:
            kwargs["log_with"] = log_with
        self.dataloader_config = (dataloader_config if dataloader_config is not None
                                  else DataLoaderConfiguration())
        if split_batches is not None:
            self.dataloader_config.split_batches = split_batches
        if getattr(self.dataloader_config, "dispatch_batches", None):
            raise ConfigError("DataLoaderConfiguration(dispatch_batches=True): shardwise has every process "
                              "read its own share; set dispatch_batches=False")
        self.profile_handler: Any = read_handlers(kwargs_handlers or [], kwargs)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        self.engine = Engine(rules=self.loop_rules(), **kwargs)
        self.engine.noun = "accelerator"  # messages name the verbs of the object the script holds
        if self.plugin_settings:  # the start-up line: where the settings came from
            said = ", ".join(f"{k}={v!r}" for k, v in self.plugin_settings.items())
            announce(self.engine.is_main_process, f"settings from {plugin_source}: {said}")
        self.gradient_state = GradientState(self.engine)
        self.state = AcceleratorState(self)
        self.flag_tensor: torch.Tensor | None = None
        check_rules(self.engine.rules, self.config)
        # Accelerate's <logging_dir>/<run> layout
        self.engine.set_logging_root(extras.logging_root(self.project_configuration))
        self.engine.save_policy_checkpoints_with(self.save_state)  # policy checkpoints: Accelerate's naming
        extras.share_process_state(self.device, self.distributed_type.value, self.num_processes,  # for
                                   self.process_index, self.local_process_index,  # accelerate.logging
                                   self.mixed_precision)  # and AcceleratorState() readers
        self._state_hooks = StateHooks()
        self._saves: dict[int, int] = {}  # save_state calls at the current step (arrival keys)
        # Accelerate's `parallelism_config` and `torch_device_mesh`: made here, on every process
        # (the mesh is a collective), when the script gave one or tensor parallelism is on
        self._layout: ParallelSizes | None = None
        self._mesh: Any = None
        if asked_layout or self.config.parallelism.tp > 1:
            self._build_layout()

    def _build_layout(self) -> None:
        try:
            dims = self.engine.parallel_dims
        except RuntimeError:  # strategy="auto": no layout before the first prepare
            return
        self._layout = ParallelSizes(dims.dp_replicate, dims.dp_shard, dims.tp, dims.cp)
        names = self._layout.active_mesh_dims
        if not names:
            return
        mesh = dims.world_mesh  # the run's one mesh (its dimensions of one process too, by name)
        layout = self._layout
        for view, over in (("dp", layout.dp_dim_names), ("dp_shard_cp", layout.dp_shard_cp_dim_names),
                           ("dp_cp", layout.dp_cp_dim_names)):
            if over:  # Accelerate's flattened views, reachable as torch_device_mesh["dp_cp"]
                flatten_mesh(mesh[tuple(over)], view)
        self._mesh = mesh

    @property
    def parallelism_config(self) -> ParallelSizes | None:
        """The run's layout under Accelerate's `ParallelismConfig` names (`data_parallel_size`,
        `dp_shard_size`, `tp_size`, `dp_cp_dim_names`, ...); None when the script gave none and
        nothing but data parallelism runs, as in Accelerate."""
        return self._layout

    @property
    def torch_device_mesh(self) -> Any:
        """Accelerate's `torch_device_mesh`: the run's one DeviceMesh (`ParallelDims.world_mesh`),
        its dimensions named (`dp_replicate`, `dp_shard`, `cp`, `tp`; Accelerate's holds those of
        more than one process only, and every name it has slices the same here), with the
        flattened `dp`, `dp_shard_cp` and `dp_cp` views; None where `parallelism_config` is."""
        return self._mesh

    @property
    def tensor_parallel_rank(self) -> int:
        return self.engine.parallel_dims.tp_rank(self.process_index)

    @property
    def data_parallel_rank(self) -> int:
        """Accelerate's: the index along dp_replicate."""
        return self.engine.parallel_dims.coordinates(self.process_index)["dp_replicate"]

    @property
    def data_parallel_shard_rank(self) -> int:
        """Accelerate's: the index along dp_shard."""
        return self.engine.parallel_dims.coordinates(self.process_index)["dp_shard"]

    def loop_rules(self) -> LoopRules:
        """Accelerate's rules with the script's configuration objects as they are now."""
        return accelerate_rules(self.dataloader_config, self._plugin, self.step_scheduler_with_optimizer)

    # -- the engine's, as they are -----------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def plan(self) -> Any:
        """strategy="auto": the plan the choice came from."""
        return self.engine.plan

    @property
    def session(self) -> Session:
        return self.engine.session

    @property
    def sync_gradients(self) -> bool:
        return self.engine.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self.engine.optimizer_step_was_skipped

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale

    @property
    def step(self) -> int:
        return self.engine.step

    @property
    def optimizer(self) -> PreparedOptimizer | None:
        return self.engine.optimizer

    @property
    def scheduler(self) -> PreparedScheduler | None:
        return self.engine.scheduler

    @property
    def active_loader(self) -> PreparedDataLoader | None:
        return self.engine.active_loader

    @property
    def loader_at_end(self) -> bool:
        return self.engine.loader_at_end

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.engine.backward(loss, **kwargs)

    def unscale_gradients(self) -> None:
        self.engine.unscale_gradients()

    def clip_grad_norm_(self, parameters: Any, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor | None:
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type)

    def init_empty(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.init_empty()

    def load_model(self, model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
                   key_map: dict[str, str] | None = None) -> None:
        self.engine.load_model(model, path, strict=strict, key_map=key_map)

    def from_pretrained(self, model_class: Any, path: str | os.PathLike[str], *, strict: bool = True,
                        key_map: dict[str, str] | None = None, **config_kwargs: Any) -> nn.Module:
        return self.engine.from_pretrained(model_class, path, strict=strict, key_map=key_map, **config_kwargs)

    def register_for_checkpointing(self, *objects: Any) -> None:
        self.engine.register_for_checkpointing(*objects)

    def memory_report(self) -> MemoryReport:
        return self.engine.memory_report()

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        return self.engine.free_memory(*objects)

    def end_training(self) -> None:
        self.engine.end_training()

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        self.engine.init_trackers(project_name, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, Any] | None = None) -> None:
        self.engine.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        return self.engine.get_tracker(name, unwrap)

    # -- what Accelerate's scripts read ----------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        return distributed_type(self.config, self.num_processes, self.device)

    @property
    def mixed_precision(self) -> str:
        return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[self.config.sharding.precision]

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def split_batches(self) -> bool:
        return bool(getattr(self.dataloader_config, "split_batches", False))

    @property
    def even_batches(self) -> bool:
        return bool(getattr(self.dataloader_config, "even_batches", True))

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value
        self.engine.set_tail("full" if value else "uneven")

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.training.grad_accum_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.engine.set_grad_accum(int(value))

    @property
    def project_dir(self) -> str | None:
        return self.config.observation.project_dir

    @property
    def logging_dir(self) -> str:
        return str(self.engine.logging_dir)

    # -- prepare, Accelerate's way --------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """As `Engine.prepare`, under Accelerate's rules (read from the configuration objects now);
        a sharded model refuses a no-grad forward run on one process alone (`SoloForwardCheck`)."""
        self.engine.set_rules(self.loop_rules())
        out = self.engine.prepare(*objects)
        for obj in out if isinstance(out, tuple) else (out,):
            sharded = isinstance(obj, FSDPModule) or (isinstance(obj, nn.Module) and holds_partitions(obj))
            if sharded and self.num_processes > 1 and not hasattr(obj, "_shardwise_solo"):
                # read by the engine's forward hook, before the all-gathers (FSDP2's, DeepSpeed
                # ZeRO-3's), for a no-grad forward
                # that no wait_for_everyone() rendezvous settled (`engine.lone`)
                check = SoloForwardCheck(self.num_processes, self.is_main_process,
                                         self.config.supervision.collective_timeout_s, lambda: self.step,
                                         self.engine.others_moved_on,
                                         type(self.unwrap_model(obj)).__name__.removeprefix("FSDP"))
                object.__setattr__(obj, "_shardwise_solo", check)
        return out

    def prepare_model(self, model: nn.Module, device_placement: Any = None,
                      evaluation_mode: bool = False) -> Any:
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

    def prepare_data_loader(self, data_loader: Any, device_placement: Any = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
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
        return self.engine.accumulate(*models)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Backward inside communicates nothing; gradients accumulate locally."""
        with self.session.strategy.no_sync(model):
            yield

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """The next backward all-reduces even inside an accumulation (DDP; elsewhere a no-op,
        as in Accelerate)."""
        return trigger_sync_in_backward(model)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
        """Accelerate's context-parallel block, for scripts written that way. shardwise splits the
        sequences at the prepared model's door (`strategies.context_parallel`), so the buffers
        are left whole, as one process sees them, inside the block and after it; the model's loss
        is the whole sequence's. A buffer whose sequence dimension is not 1 is refused in one line."""
        dims = list(buffer_seq_dims or [])
        if buffers is not None and dims and len(dims) != len(buffers):
            raise ValueError(f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} "
                             "buffer_seq_dims")
        if any(d != 1 for d in dims) and self.engine.parallel_dims.cp > 1:
            raise ValueError(f"maybe_context_parallel: buffer_seq_dims={dims}: shardwise splits dimension 1 "
                             "(batch, sequence, ...) of what the model is called with")
        del no_restore_buffers
        yield

    def join_uneven_inputs(self, joinables: list[Any],
                           even_batches: bool | None = None) -> contextlib.AbstractContextManager[None]:
        """Let processes with fewer batches finish (DDP: torch's Join; elsewhere a warning)."""
        return join_uneven_inputs(self, joinables, even_batches)

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[torch.profiler.profile]:
        """Accelerate's profiler with its `ProfileKwargs` (`shardwise.accelerate.extras.profile`)."""
        with extras.profile(profile_handler or self.profile_handler, self.process_index,
                            self.wait_for_everyone) as profiler:
            yield profiler

    # -- odds and ends ---------------------------------------------------------------------
    def clear(self, *objects: Any) -> tuple[Any, ...]:  # Accelerate's alias of `free_memory`
        return self.free_memory(*objects)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """`torch.save` on the main process."""
        if self.is_main_process:
            torch.save(obj, f)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        return self.engine.unwrap_model(model)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        return self.engine.get_state_dict(model)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True, *,
                   merge_adapters: bool = False) -> None:
        if not safe_serialization:
            raise ConfigError("save_model(safe_serialization=False): shardwise writes safetensors only")
        self.engine.save_model(model, save_directory, max_shard_size, merge_adapters=merge_adapters)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[Any]:
        return self.engine.autocast()

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the duplicates that evened out the last batch; objects that are not
        tensors are gathered as objects (as Accelerate does)."""
        if not use_gather_object and all_tensors(input_data):
            return self.engine.gather_for_metrics(input_data)
        if self.num_processes == 1:
            return input_data
        parts: list[Any] = [None] * self.num_processes
        self.engine.meet("gather_for_metrics")
        with self.engine.timeouts():
            dist.all_gather_object(parts, input_data)
        flat = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        keep = self.engine.real_in_last_batch()
        return flat if keep is None else flat[:keep]

    # -- checkpoints with Accelerate's automatic naming -----------------------------------------
    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """`hook(models, weights, output_dir)`, before a save writes (`accelerate.hooks.StateHooks`)."""
        return self._state_hooks.add(self._state_hooks.save, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """`hook(models, input_dir)`, before a load reads; returns a handle with `remove()`."""
        return self._state_hooks.add(self._state_hooks.load, hook)

    def _replicated(self) -> bool:
        """Every process holds the whole model and optimizer state (ddp, or one process; not
        with tensor parallelism, whose processes each hold a share of every split layer)."""
        return self.config.parallelism.tp == 1 and self.distributed_type in (
            DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    def _save_together(self) -> bool:
        """False when this process alone called save_state (refused where the state is sharded)."""
        sharded_as = None if self._replicated() else self.distributed_type.value
        timeout = self.config.supervision.collective_timeout_s
        return save_together(self._saves, self.step, self.num_processes, self.process_index, timeout,
                             sharded_as, self.engine.others_moved_on)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, *, keep_last: int | None = None,
                   **save_model_func_kwargs: Any) -> Path:
        """Accelerate's automatic naming, safe for earlier runs' checkpoints: the run owns
        `<project_dir>/checkpoints` (`checkpoint.runlock`); a save never goes into an existing
        `checkpoint_<i>`: a fresh run continues the numbering after the newest one there (where
        Accelerate refuses); `total_limit` removes only checkpoints this process wrote and only
        while they hold nothing but the checkpoint (others stay, with one warning)."""
        pc = self.project_configuration
        self.engine.meet("save_state")  # after wait_for_everyone(): the main process's call is known first
        together = self._save_together()
        # ddp: a world-of-one checkpoint
        alone = contextlib.nullcontext() if together else world_of_one(self.engine)
        if output_dir is not None or not getattr(pc, "automatic_checkpoint_naming", False):
            with alone:
                path = self.engine.save_state(output_dir, keep_last=keep_last)
            self._after_save(path)
            return path
        checkpoints = self.engine.checkpoints
        numbered = self._numbered()
        runlock.hold(numbered.root, self.process_index, self.engine.config.checkpointing.lock_lease_s)
        start = [numbered.next_index()]
        if self.num_processes > 1 and together:  # process 0's listing: every process saves to the same folder
            dist.broadcast_object_list(start, src=0)
        if start[0] != pc.iteration and self.is_main_process and not numbered.written:
            warnings.warn(f"{numbered.folder(pc.iteration)} exists (an earlier run's): this run's "
                          f"checkpoints start at checkpoint_{start[0]}", stacklevel=2)
        with alone:
            path = self.engine.save_state(numbered.folder(start[0]))
        self._after_save(path)
        old = numbered.saved(path)
        if old and self.is_main_process:  # checkpoint_async: only once the new one is complete
            checkpoints.after(lambda: prune_checkpoints(old))
        if together:
            self.wait_for_everyone()
        return path

    def _numbered(self) -> NumberedFolders:
        """Accelerate's `checkpoint_<i>` naming, kept by the engine's checkpoint manager."""
        naming = self.engine.checkpoints.naming
        if isinstance(naming, NumberedFolders) and naming.project is self.project_configuration:
            return naming
        return self.engine.checkpoints.number_like_accelerate(self.project_configuration)

    def _after_save(self, path: Path) -> None:
        """The save hooks, which write into the checkpoint folder: it must be in place first (with
        checkpoint_async, the save is waited for when there are hooks). Sharded models' weights
        are gathered for them first, on every process (`adapters.full_weights_held`)."""
        if not self._state_hooks.save:
            return
        self.engine.checkpoints.wait()
        models = self._hook_models()
        before = rng_state()
        with full_weights_held(models) as weights, self.engine.whole_emas():
            self._state_hooks.after_save(models, weights, str(path))
        # Accelerate saves the RNG after its hooks: what they drew is in the state a resume continues from
        save_rng_after_hooks(path, self.process_index, before)

    def _hook_models(self) -> list[nn.Module]:
        """The models as Accelerate hands them to its hooks: unwrapped from DDP, sharded as they are."""
        return [self.unwrap_model(m) for m in self.session.models]

    def load_state(self, input_dir: str | os.PathLike[str] | None = None,
                   **load_model_func_kwargs: Any) -> int | None:
        """As `Engine.load_state` (with Accelerate's automatic naming: the newest `checkpoint_<i>`).
        Accelerate restores weights, optimizer, schedulers and RNG, not where a DataLoader stood
        (its epoch, its place in it): its scripts skip the seen batches themselves
        (skip_first_batches or a `continue`), and would skip twice if the position came back;
        so unless use_stateful_dataloader=True, positions are not restored (`LoopRules`)."""
        pc = self.project_configuration
        if input_dir is None and getattr(pc, "automatic_checkpoint_naming", False):
            numbered = self._numbered()
            runlock.hold(numbered.root, self.process_index, self.engine.config.checkpointing.lock_lease_s)
            found = numbered.newest()  # (the next save goes past it)
            if found is None:
                raise FileNotFoundError(f"no checkpoint_<i> folder under {numbered.root} to load")
            input_dir = found
        if input_dir is not None:
            self._state_hooks.before_load(self._hook_models(), str(input_dir))
            self.engine.reshard_emas()  # (a load hook may have given a prepared EMA whole shadows)
        self.engine.set_rules(self.loop_rules())
        return self.engine.load_state(input_dir)

