"""Accelerate's rules, read from the objects an Accelerate script passes, as the `LoopRules` the
`Accelerator`'s engine follows; and Accelerate's `DistributedType` of a run, read from the
strategy and backend tables (`shardwise.config`).

The differences themselves are listed in `shardwise.engine.loop_rules` (one field each) and in the
table of docs/api.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any

import torch

from ..config.tree import ConfigError, EngineConfig, backend_spec, is_auto, strategy_spec
from ..engine.loop_rules import LoopRules
from .objects import DistributedType

# the plugins shardwise cannot honour (the others are translated: `accelerate.plugins`)
_REFUSED = {"megatron_lm_plugin": "Megatron-LM's pipeline and tensor parallelism is not an engine of "
                                  "shardwise; use tensor_parallel_size (or TorchTensorParallelPlugin) with a "
                                  "ZeRO strategy"}
log = logging.getLogger("shardwise")


def read_dynamo(kwargs: dict[str, Any]) -> None:
    """`Accelerator(dynamo_backend=...)` or `dynamo_plugin=TorchDynamoPlugin(...)` (popped from
    `kwargs`) -> the engine's compile settings (`config.translate.from_dynamo`): backend NO compiles
    nothing; any other compiles each block. Backend options, and both keywords at once, are
    refused in one line; Accelerate's whole-model compilation is named in one log line."""
    backend, plugin = kwargs.pop("dynamo_backend", None), kwargs.pop("dynamo_plugin", None)
    if backend is not None and plugin is not None:
        raise ConfigError("Accelerator(dynamo_backend=..., dynamo_plugin=...): pass one of them (the plugin "
                          "names its backend)")
    if backend is None and plugin is None:
        return
    from ..config.translate import from_dynamo

    fields = {"backend": backend} if plugin is None else dict(vars(plugin))
    if plugin is None:  # Accelerate compiles the whole model unless a plugin asks for regions
        fields["use_regional_compilation"] = False
    where = "Accelerator(dynamo_plugin=...)" if plugin is not None else "Accelerator(dynamo_backend=...)"
    settings, notes = from_dynamo(fields, where)
    kwargs.update(settings)
    if notes and os.environ.get("RANK", "0") == "0":
        log.warning("%s: %s", where, "; ".join(notes))


def read_parallelism(kwargs: dict[str, Any], world_size: int) -> None:
    """`Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size))`
    (popped from `kwargs`) -> the engine's `parallelism` section (`config.translate.from_parallelism`:
    context and sequence parallelism, and sizes whose product is not the process count, are
    refused in one line)."""
    config = kwargs.pop("parallelism_config", None)
    if config is None:
        return
    from ..config.translate import from_parallelism

    if dataclasses.is_dataclass(config):
        sizes = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    else:
        sizes = dict(vars(config))
    section = from_parallelism(sizes, world_size, "Accelerator(parallelism_config=...)")
    if section is not None:
        kwargs.setdefault("parallelism", section)


def refuse_unsupported(kwargs: dict[str, Any], *, device_placement: bool) -> None:
    """Refuse Accelerate's plugins for other engines (popped from `kwargs`) and
    `device_placement=False`, each in one line."""
    for name, why in _REFUSED.items():
        if kwargs.pop(name, None) is not None:
            raise ConfigError(f"Accelerator({name}=...): {why}")
    if not device_placement:
        raise ConfigError("Accelerator(device_placement=False): shardwise places prepared models and "
                          "batches on the process's device; move tensors yourself only outside prepare()")


def accumulation_steps(steps: int, plugin: Any) -> int:
    """`gradient_accumulation_steps`, or a `GradientAccumulationPlugin`'s `num_steps` (not both)."""
    if plugin is None:
        return steps
    if getattr(plugin, "sync_with_dataloader", True) is False:
        raise ConfigError("GradientAccumulationPlugin(sync_with_dataloader=False): shardwise always "
                          "ends an accumulation at the end of the DataLoader")
    if steps != 1:
        raise ConfigError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
    return int(getattr(plugin, "num_steps", None) or 1)


def read_handlers(handlers: list[Any], kwargs: dict[str, Any]) -> Any:
    """Accelerate's kwargs handlers: InitProcessGroupKwargs' timeout goes into `kwargs`
    (`collective_timeout_s`); the ProfileKwargs comes back (None without one); others are
    not applied, with a warning."""
    profile = None
    for handler in handlers:
        timeout = getattr(handler, "timeout", None)
        if type(handler).__name__ == "InitProcessGroupKwargs" and timeout is not None:
            kwargs["collective_timeout_s"] = timeout.total_seconds()
        elif type(handler).__name__ == "ProfileKwargs":
            profile = handler
        else:
            warnings.warn(f"{type(handler).__name__} is not applied by shardwise (its settings are "
                          "Accelerate's and PyTorch DDP's)", stacklevel=3)
    return profile


def accelerate_rules(dataloader_config: Any, plugin: Any, step_scheduler_with_optimizer: bool) -> LoopRules:
    """The rules of Accelerate, with the script's `DataLoaderConfiguration` and
    `GradientAccumulationPlugin` (read by their fields; None: Accelerate's defaults)."""
    seedable = bool(getattr(dataloader_config, "use_seedable_sampler", False))
    data_seed = getattr(dataloader_config, "data_seed", None)
    return LoopRules(
        tail="full" if getattr(dataloader_config, "even_batches", True) else "uneven",
        split_batches=bool(getattr(dataloader_config, "split_batches", False)),
        seedable_sampler=seedable,
        data_seed=int(data_seed) if seedable and data_seed is not None else None,
        resume_draws=True,
        restore_outer_loader=True,
        sync_each_batch=bool(getattr(plugin, "sync_each_batch", False)),
        restore_loader_position=bool(getattr(dataloader_config, "use_stateful_dataloader", False)),
        scheduler_steps_per_process=True,
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
    )


def check_rules(rules: LoopRules, config: EngineConfig) -> None:
    """Refuse rules the configured backend cannot follow."""
    backend = config.sharding.backend
    if rules.sync_each_batch and not backend_spec(backend).sync_each_batch:
        raise ConfigError(f"GradientAccumulationPlugin(sync_each_batch=True): backend={backend!r} "
                          "syncs at its own accumulation boundary only; drop sync_each_batch or use "
                          "backend='torch'")


def distributed_type(config: EngineConfig, world: int, device: torch.device) -> DistributedType:
    """What Accelerate's `distributed_type` says of this run: NO on one process, else the
    backend's name or, where the backend has none, the strategy's (before `strategy='auto'`
    chose one: FSDP); MULTI_GPU is MULTI_CPU on CPU processes."""
    if world == 1:
        return DistributedType.NO
    name = backend_spec(config.sharding.backend).distributed_type
    if name is None:
        # strategy="auto" before it chose: sharded, as every strategy but ddp
        strategy = config.sharding.strategy
        name = DistributedType.FSDP.value if is_auto(strategy) else strategy_spec(strategy).distributed_type
    kind = DistributedType(name)
    if kind is DistributedType.MULTI_GPU and device.type != "cuda":
        return DistributedType.MULTI_CPU
    return kind
