"""DeepSpeed's import and its config dict for our config (`backend="deepspeed"`).

`deepspeed_config` is pure (it imports no deepspeed): a config is checked, and tested, without
DeepSpeed installed. `import_deepspeed` is the one `import deepspeed` of the package.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any

import torch

from ...config.parallelism import resolve_shard_group
from ...config.tree import (
    STRATEGY_TABLE,
    ConfigError,
    EngineConfig,
    check_strategy,
    offload_spec,
)

# Keys of a user's DeepSpeed JSON `zero_optimization` section that tune DeepSpeed itself and pass
# through untouched (ZeRO++ hpZ's `zero_hpz_partition_size` among them: it runs on CPU processes
# and changes no number); the stage, the offload targets and MiCS's sharding group (imported as
# shard_group_size, see `shardwise.config.translate`; DeepSpeed 0.19 refuses the keys) come from our config.
_OURS = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params",
         "mics_shard_size", "mics_hierarchical_params_gather"}


def import_deepspeed(device: torch.device) -> Any:
    """`import deepspeed`, or one clear error naming the install command."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the CPU accelerator, even beside GPUs
    try:
        import deepspeed
    except ImportError as err:
        raise ConfigError(
            f"backend='deepspeed' needs DeepSpeed, which is not importable here ({err}); install it "
            "with: pip install 'shardwise[deepspeed]'  (or choose backend='torch')"
        ) from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed 0.19 calls collectives torch 2.13 renamed; one warning per call is noise to users
    renamed = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"
    warnings.filterwarnings("ignore", renamed, FutureWarning)
    return deepspeed


def check_shard_group(cfg: EngineConfig, world_size: int, local_world_size: int) -> None:
    """Refuse, in one line, a sharding group smaller than the world on DeepSpeed (pure).

    Hybrid sharding on DeepSpeed was MiCS (`mics_shard_size`: parameters, gradients and optimizer
    states sharded within each group, replicated across groups); DeepSpeed 0.19 removed it and
    refuses the key. ZeRO++ hpZ (`zero_hpz_partition_size`) is no replacement: it keeps gradients
    and optimizer states sharded across all processes and adds a secondary parameter copy per
    group, so the group's states would not be what `shard_group_size` promises (a DeepSpeed
    JSON's hpZ key passes through to DeepSpeed as it is: measured on 4 CPU processes, it runs
    and matches one process). A group of all processes (None, or "node" on one node) is plain
    ZeRO and runs.
    """
    group = resolve_shard_group(cfg.sharding.shard_group_size, world_size, local_world_size)
    if group < world_size and STRATEGY_TABLE[cfg.sharding.strategy].shards_optimizer:
        raise ConfigError(
            f"shard_group_size={cfg.sharding.shard_group_size!r} (groups of {group} of {world_size} "
            "processes) is not supported by backend='deepspeed': DeepSpeed 0.19 removed MiCS "
            "(mics_shard_size), its hybrid sharding; use backend='torch' for shard_group_size"
        )


def deepspeed_config(cfg: EngineConfig, *, device: torch.device, numel: int) -> dict[str, Any]:
    """The DeepSpeed config dict for our config (pure: no deepspeed import).

    `numel` (the model's parameter count) caps the bucket sizes: DeepSpeed's defaults (5e8
    elements) allocate ~2 GB of fp32 buffers per rank whatever the model.
    """
    check_strategy(cfg.sharding.strategy, cfg.sharding.offload, "deepspeed")
    if cfg.sharding.precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            "precision='fp16' with backend='deepspeed' needs CUDA: DeepSpeed's CPU accelerator has "
            "no fp16; use precision='bf16' (or backend='torch', whose fp16 runs on CPU)"
        )
    bucket = int(max(1, min(cfg.sharding.offload_bucket_numel, numel)))
    pin = device.type == "cuda"
    # tuning defaults: a DeepSpeed JSON's zero_optimization keys (`deepspeed_config`) win over these
    tuning: dict[str, Any] = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    spec, offload = STRATEGY_TABLE[cfg.sharding.strategy], offload_spec(cfg.sharding.offload)
    if spec.shards_params:
        # zero3 means on DeepSpeed what it means on FSDP2: every parameter sharded (DeepSpeed
        # keeps ones under 1e5 elements whole), and a block's full parameters exist only while
        # it computes. DeepSpeed's default reuse distance (1e9 elements) keeps every parameter
        # used again within 1e9 elements gathered from forward to backward: on a model under
        # ~0.5B parameters, all of them (zero2's footprint, one all-gather per step instead of two)
        tuning |= {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                   "stage3_prefetch_bucket_size": bucket}
    zero: dict[str, Any] = {"stage": spec.stage}
    if offload.optimizer_on_host:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if offload.params_on_host:  # parameters on the host too (and the step there, as on torch)
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    user = cfg.sharding.deepspeed_config
    zero = tuning | (_user_zero_keys(user) if user else {}) | zero
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the DataLoader sets the batch
        "gradient_accumulation_steps": 1,  # the Engine divides the loss by grad_accum_steps
        "gradient_clipping": float(cfg.training.max_grad_norm or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the user's torch optimizer, under ZeRO
        "zero_force_ds_cpu_optimizer": False,  # ... also under offload: never swapped
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.parallelism.tp > 1:  # AutoTP: the Linear layers split at deepspeed.initialize
        out["tensor_parallel"] = {"autotp_size": cfg.parallelism.tp}
    return out | _precision_keys(cfg)


def _precision_keys(cfg: EngineConfig) -> dict[str, Any]:
    """DeepSpeed's section for our precision: bf16 autocast, fp16 with its loss scaler, fp32 none."""
    if cfg.sharding.precision == "bf16":
        # fp32 weights and autocast compute; no module reduces in bf16 (an empty safe list)
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
    if cfg.sharding.precision == "fp16":
        ls = cfg.sharding.loss_scale
        return {"fp16": {
            "enabled": True,
            # DeepSpeed casts the weights to fp16; without auto_cast a float input (pixels,
            # features, a float mask) stays fp32 and the first matmul fails on mixed dtypes.
            # Accelerate sets it too.
            "auto_cast": True,
            "loss_scale": 0 if ls.dynamic else ls.init_scale,
            "initial_scale_power": round(math.log2(ls.init_scale)),
            "loss_scale_window": ls.growth_interval,
            "hysteresis": ls.hysteresis,
            "min_loss_scale": ls.min_scale,
        }}
    return {}


def _user_zero_keys(path: str) -> dict[str, Any]:
    """Tuning keys of a DeepSpeed JSON's zero_optimization section ("auto" ones left out)."""
    from ...config.files import read_file  # the same checks and one-line errors as every config file

    zero = read_file(path).get("zero_optimization") or {}
    return {k: v for k, v in zero.items() if k not in _OURS and v != "auto"}


