"""Accelerate's plain objects, under its names and fields, for `shardwise.Accelerator`: the
configuration dataclasses a script passes (read by their fields; accelerate is never imported),
and the states it reads from the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..distributed.world import backends_of
from ..engine import Engine
from ..engine.data import PreparedDataLoader

__all__ = ["DataLoaderConfiguration", "DistributedType", "GradientAccumulationPlugin", "ParallelSizes",
           "ProjectConfiguration"]


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
    """Accelerate's `gradient_state`, read from the engine's step state and the loader whose loop
    is under way (`engine.loop_state.LoaderTracker`: when a loop ends, the one active before it)."""

    def __init__(self, engine: Engine) -> None:
        self._acc = engine

    @property
    def sync_gradients(self) -> bool:
        return self._acc.sync_gradients

    @property
    def num_steps(self) -> int:
        return self._acc.config.training.grad_accum_steps

    @property
    def end_of_dataloader(self) -> bool:
        return self._acc.loader_at_end

    @property
    def remainder(self) -> int:
        loader = self._acc.active_loader
        return loader.remainder() if loader is not None and self._acc.loader_at_end else -1

    @property
    def in_dataloader(self) -> bool:  # until the loop over it ends (then the loader before it is active)
        return self._acc.active_loader is not None

    @property
    def active_dataloader(self) -> PreparedDataLoader | None:
        """The prepared loader whose pass is under way (None between passes)."""
        loader = self._acc.active_loader
        return loader if loader is not None and loader.served > 0 else None

    # Accelerate's GradientState reads adjust_scheduler from the plugin's non-default fields, so
    # with its default (True) it reads False and its scheduler never counts micro-steps: neither
    # does ours, whatever the plugin says
    adjust_scheduler = False
    sync_with_dataloader = True


class AcceleratorState:
    """Accelerate's `state`: where this process sits and how the run is set up."""

    _FROM_ACCELERATOR = ("num_processes", "process_index", "local_process_index", "device",
                         "distributed_type", "mixed_precision", "is_main_process", "is_local_main_process",
                         "is_last_process", "use_distributed")

    def __init__(self, acc: Any) -> None:
        self._acc = acc

    def __getattr__(self, name: str) -> Any:
        if name in self._FROM_ACCELERATOR:
            return getattr(self._acc, name)
        if name in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "dynamo_plugin"):
            return None
        if name == "backend":
            # the backend of this run's device, as Accelerate names it ("nccl" on a GPU run)
            return backends_of().get(self._acc.device.type) if dist.is_initialized() else None
        raise AttributeError(f"AcceleratorState.{name} is not offered by shardwise")

    def __repr__(self) -> str:
        """Accelerate's text (`logger.info(accelerator.state)` in its scripts)."""
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: {self.distributed_type}{backend}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
                f"\nMixed precision type: {self.mixed_precision}\n")


@dataclass(frozen=True)
class ParallelSizes:
    """`accelerator.parallelism_config`: the run's layout (`engine.parallel_dims`) under the
    names and properties of Accelerate's `ParallelismConfig`, so a script sizing its loaders by
    `data_parallel_size` (or reading `dp_cp_dim_names` for `torch_device_mesh`) runs unchanged."""

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    sp_size: int = 1

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        """Processes that take different samples: the loaders' split."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    # Accelerate's names for its implementations: shardwise's cp splits at the model's door (its
    # Ulysses is a cp mode); there is no DeepSpeed sequence parallelism (transformers' Trainer reads both)
    cp_backend = "torch"
    sp_backend = "none"
    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    def _named(self, *names: str) -> list[str]:
        return [n for n in names if getattr(self, f"{n}_size") > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        return self._named("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        return self._named("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return self._named("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return self._named("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        return [*self._named("dp_replicate"), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names
