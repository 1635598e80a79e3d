"""Foreign config formats as pure translators: a DeepSpeed JSON or an Accelerate YAML becomes
shardwise settings plus the list of what had no equivalent. Nothing here imports deepspeed or
accelerate; both are tested on fixture files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .tree import ConfigError

_ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def _flag(value: Any, where: str) -> bool | None:
    """DeepSpeed and Accelerate write booleans as true, "true", "auto"...; None means auto."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value == "auto" or value is None:
        return None
    raise ConfigError(f"{where}: expected true, false or \"auto\", found {value!r}")


def _number(value: Any, where: str) -> Any:
    if value == "auto" or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected a number or \"auto\", found {value!r}")


def _offload_device(block: Any, where: str) -> bool:
    if not isinstance(block, Mapping):
        return False
    device = str(block.get("device", "none")).lower()
    if device == "nvme":
        raise ConfigError(f"{where}.device: 'nvme' offload is not supported; use \"cpu\" (host memory)")
    if device not in ("cpu", "none"):
        raise ConfigError(f"{where}.device: expected \"cpu\" or \"none\", found {device!r}")
    return device == "cpu"


# Keys that tune DeepSpeed's own implementation and mean nothing on FSDP2: reported, not errors.
_DS_TUNING = {
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
    "reduce_bucket_size", "contiguous_gradients", "sub_group_size", "round_robin_gradients",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "zero_quantized_weights",
    "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters", "cpu_offload",
}


def from_deepspeed(ds: Mapping[str, Any], source: str = "deepspeed JSON") -> tuple[dict[str, Any], list[str]]:
    """DeepSpeed JSON -> (shardwise settings, dropped keys)."""
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in ds.items():
        where = f"{source}: {key}"
        if key == "zero_optimization":
            out.update(_ds_zero(value, where, dropped))
        elif key in ("fp16", "bf16", "bfloat16"):
            out.update(_ds_precision(key, value, where, dropped))
        elif key in _DS_NUMBERS:
            n = _number(value, where)
            if key == "gradient_accumulation_steps":
                if n != "auto":
                    out["grad_accum_steps"] = int(n)
            elif key == "gradient_clipping":
                # "auto" is the Hugging Face Trainer's max_grad_norm default; 0 switches clipping off.
                out["max_grad_norm"] = 1.0 if n == "auto" else (float(n) or None)
            else:
                out[_DS_NUMBERS[key]] = n
        elif key in ("optimizer", "scheduler"):
            out[key], more = (_ds_optimizer if key == "optimizer" else _ds_scheduler)(value, where)
            dropped += more
        elif key == "tensor_parallel":
            out.update(_ds_tensor_parallel(value, where, dropped))
        else:
            dropped.append(key)
    return out, dropped


def _ds_tensor_parallel(value: Any, where: str, dropped: list[str]) -> dict[str, Any]:
    """`tensor_parallel.autotp_size` (DeepSpeed's AutoTP) -> tensor_parallel_size."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object, found {value!r}")
    size = value.get("autotp_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{where}.autotp_size: expected an integer >= 1, found {size!r}")
    dropped += [f"tensor_parallel.{sub}" for sub in value if sub != "autotp_size"]
    return {"tensor_parallel_size": size} if size > 1 else {}


# numbers a DeepSpeed JSON holds -> our key (accumulation and clipping are translated above)
_DS_NUMBERS = {"gradient_accumulation_steps": "grad_accum_steps", "gradient_clipping": "max_grad_norm",
               "train_micro_batch_size_per_gpu": "micro_batch_size", "train_batch_size": "train_batch_size"}
_DS_PRECISION_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                      "min_loss_scale")


def _ds_zero(value: Any, where: str, dropped: list[str]) -> dict[str, Any]:
    """`zero_optimization`: the stage, offload and the hybrid group."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object, found {value!r}")
    stage = value.get("stage", 0)
    if stage not in _ZERO_STAGES:
        raise ConfigError(f"{where}.stage: expected 0, 1, 2 or 3, found {stage!r}")
    out: dict[str, Any] = {"strategy": _ZERO_STAGES[stage]}
    opt = _offload_device(value.get("offload_optimizer"), f"{where}.offload_optimizer")
    par = _offload_device(value.get("offload_param"), f"{where}.offload_param")
    if par:
        out["offload"] = "params"
    elif opt:
        out["offload"] = "optimizer"
    group = _ds_shard_group(value, stage, where)
    if group is not None:
        out["shard_group_size"] = group
    for sub in value:
        if sub == "mics_hierarchical_params_gather" and _flag(value[sub], f"{where}.{sub}"):
            dropped.append(f"zero_optimization.{sub} (MiCS's two-hop all-gather: shardwise "
                           "gathers within the group directly)")
        elif sub == "zero_hpz_partition_size" and value[sub] not in (0, 1, "auto"):
            dropped.append(f"zero_optimization.{sub} (ZeRO++ hpZ: run as given by "
                           "backend='deepspeed'; for hybrid sharding set shard_group_size)")
        elif sub not in ("stage", "offload_optimizer", "offload_param", *_DS_HYBRID):
            dropped.append(f"zero_optimization.{sub}")
    return out


def _ds_precision(key: str, value: Any, where: str, dropped: list[str]) -> dict[str, Any]:
    """`fp16` / `bf16` / `bfloat16`: the precision, and fp16's loss scaling."""
    out: dict[str, Any] = {}
    block = value if isinstance(value, Mapping) else {"enabled": value}
    if _flag(block.get("enabled", False), f"{where}.enabled"):
        out["precision"] = "fp16" if key == "fp16" else "bf16"
    if key == "fp16":
        scale = _fp16_loss_scale(block, where)
        if scale:
            out["loss_scale"] = scale
    dropped += [f"{key}.{sub}" for sub in block if sub not in _DS_PRECISION_KEYS]
    return out


_DS_HYBRID = ("mics_shard_size", "mics_hierarchical_params_gather", "zero_hpz_partition_size")


def _ds_shard_group(zero: Mapping[str, Any], stage: Any, where: str) -> int | None:
    """DeepSpeed's hybrid keys -> shard_group_size (None: shard across all processes).

    MiCS (`mics_shard_size: N`, ZeRO-3 only) partitions parameters, gradients and optimizer
    states within each group of N consecutive ranks, replicates them across groups and
    all-reduces gradients across groups: exactly `shard_group_size=N` on zero3. ZeRO++ hpZ
    (`zero_hpz_partition_size: N`) is not: it keeps gradients and optimizer states partitioned
    across all processes and adds a secondary copy of the parameters partitioned within groups
    of N for the backward all-gather. shard_group_size=N would hold N times more optimizer state
    per rank than the JSON asked for, so hpZ is not imported as a group: it stays a DeepSpeed
    tuning key, passed to DeepSpeed as it is under backend='deepspeed' (where it runs), reported
    with that reason, and refused only when it is no size.
    """
    hpz = _number(zero.get("zero_hpz_partition_size", 1), f"{where}.zero_hpz_partition_size")
    if hpz != "auto" and (not isinstance(hpz, int) or hpz < 0):
        raise ConfigError(f"{where}.zero_hpz_partition_size: expected an integer >= 0, found {hpz!r}")
    mics = _number(zero.get("mics_shard_size", -1), f"{where}.mics_shard_size")
    if mics in (-1, "auto"):
        return None
    if not isinstance(mics, int) or mics < 1:
        raise ConfigError(f"{where}.mics_shard_size: expected a positive integer (-1: off), found {mics!r}")
    if stage != 3:
        raise ConfigError(f"{where}.mics_shard_size: MiCS is ZeRO stage 3's; found stage {stage!r}")
    return mics


def _fp16_loss_scale(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    scale: dict[str, Any] = {}
    static = _number(block.get("loss_scale", 0), f"{where}.loss_scale")
    if static not in (0, "auto"):
        scale.update(dynamic=False, init_scale=float(static))
    elif "initial_scale_power" in block:
        scale["init_scale"] = 2.0 ** int(
            _number(block["initial_scale_power"], f"{where}.initial_scale_power")
        )
    if "loss_scale_window" in block:
        scale["growth_interval"] = int(_number(block["loss_scale_window"], f"{where}.loss_scale_window"))
    if "hysteresis" in block:
        scale["hysteresis"] = int(_number(block["hysteresis"], f"{where}.hysteresis"))
    if "min_loss_scale" in block:
        scale["min_scale"] = float(_number(block["min_loss_scale"], f"{where}.min_loss_scale"))
    return scale


_OPT_TYPES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


def _ds_optimizer(value: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    if not isinstance(value, Mapping) or "type" not in value:
        raise ConfigError(f"{where}: expected an object with a \"type\", found {value!r}")
    kind = _OPT_TYPES.get(str(value["type"]).lower())
    if kind is None:
        raise ConfigError(
            f"{where}.type: {value['type']!r} is not supported; choose one of: AdamW, Adam, SGD"
        )
    out: dict[str, Any] = {"type": kind}
    dropped = []
    for k, v in (value.get("params") or {}).items():
        if k in ("lr", "weight_decay", "eps", "momentum"):
            out[k] = _number(v, f"{where}.params.{k}")
        elif k == "betas":
            out[k] = v if v == "auto" else tuple(v)
        elif k == "adam_w_mode":
            out[k] = bool(_flag(v, f"{where}.params.{k}"))
        elif k == "torch_adam":
            pass  # we always run torch's implementation
        else:
            dropped.append(f"optimizer.params.{k}")
    return out, dropped


def _ds_scheduler(value: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    kinds = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
    if not isinstance(value, Mapping) or value.get("type") not in kinds:
        found = value.get("type") if isinstance(value, Mapping) else value
        raise ConfigError(f"{where}.type: {found!r} is not supported; choose one of: {', '.join(kinds)}")
    out: dict[str, Any] = {"type": value["type"]}
    dropped = []
    for k, v in (value.get("params") or {}).items():
        if k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"):
            out[k] = _number(v, f"{where}.params.{k}")
        elif k == "warmup_type":
            out[k] = v
        else:
            dropped.append(f"scheduler.params.{k}")
    return out, dropped


# -- Accelerate -------------------------------------------------------------------------------
_FSDP_SHARDING = {
    "1": "zero3", "FULL_SHARD": "zero3",
    "2": "zero2", "SHARD_GRAD_OP": "zero2",
    "3": "ddp", "NO_SHARD": "ddp",
    "4": "zero3", "HYBRID_SHARD": "zero3",
    "5": "zero2", "HYBRID_SHARD_ZERO2": "zero2",
}
_ACC_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
# Values that ask for nothing (Accelerate writes them into every file): not reported as dropped.
_ACC_NEUTRAL = {
    "compute_environment": "LOCAL_MACHINE", "main_training_function": "main", "downcast_bf16": "no",
    "same_network": True, "gpu_ids": "all", "tpu_use_cluster": False, "tpu_use_sudo": False,
    "enable_cpu_affinity": False, "debug": False,
}


def from_accelerate(
    acc: Mapping[str, Any],
    source: str = "accelerate YAML",
    read_json: Callable[[str], Mapping[str, Any]] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Accelerate config YAML -> (shardwise settings, dropped keys).

    A `deepspeed_config_file` is read with `read_json` and translated in: as in Accelerate, that
    JSON then decides stage, offload, precision, accumulation and clipping. Hybrid sharding:
    `HYBRID_SHARD` / `HYBRID_SHARD_ZERO2` (4 / 5) are zero3 / zero2 within a node
    (shard_group_size "node", as FSDP's hybrid shards within a node), unless a
    `parallelism_config` section gives the sizes (`from_parallelism`), which then decide.
    """
    dropped: list[str] = []
    kind = str(acc.get("distributed_type", "NO")).upper()
    out = _acc_kind(acc, kind, source, read_json, dropped)
    _acc_precision(acc, kind, source, out, dropped)
    out["launch"], total = _acc_launch(acc, kind, source)
    if acc.get("gradient_accumulation_steps"):
        out["grad_accum_steps"] = int(acc["gradient_accumulation_steps"])
    if acc.get("parallelism_config"):
        _acc_parallelism(acc, kind, total, source, out)
    if acc.get("dynamo_config"):
        compiled, notes = from_dynamo(acc["dynamo_config"], f"{source}: dynamo_config")
        out.update(compiled)
        dropped += [f"dynamo_config.{note}" for note in notes]
    for key, value in acc.items():
        if key in _ACC_HANDLED:
            continue
        if not value or _ACC_NEUTRAL.get(key, object()) == value:
            continue  # empty, off or the default: nothing was asked for
        dropped.append(key)
    return out, dropped


_ACC_HANDLED = {"distributed_type", "fsdp_config", "deepspeed_config", "mixed_precision", "use_cpu",
                "num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port",
                "rdzv_backend", "gradient_accumulation_steps", "parallelism_config", "dynamo_config"}


def _acc_kind(acc: Mapping[str, Any], kind: str, source: str,
              read_json: Callable[[str], Mapping[str, Any]] | None, dropped: list[str]) -> dict[str, Any]:
    """`distributed_type` (and its section): the strategy; a DeepSpeed JSON it names, read in."""
    out: dict[str, Any] = {}
    if kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        out["strategy"] = "ddp"
        if kind == "MULTI_CPU":
            out["cpu"] = True
    elif kind == "FSDP":
        out.update(acc_fsdp(acc.get("fsdp_config") or {}, dropped, source))
    elif kind == "DEEPSPEED":  # the DeepSpeed engine, as Accelerate runs it (and its DeepSpeedPlugin)
        out["backend"] = "deepspeed"
        out.update(_acc_deepspeed(acc.get("deepspeed_config") or {}, dropped, source))
        ds_file = out.pop("deepspeed_config", None)
        if ds_file is not None:
            if read_json is None:
                raise ConfigError(f"{source}: deepspeed_config_file {ds_file!r} cannot be read here")
            from_json, more = from_deepspeed(read_json(ds_file), source=ds_file)
            out.update(from_json)
            dropped += more
    else:
        raise ConfigError(
            f"{source}: distributed_type: {kind!r} is not supported; "
            "shardwise reads NO, MULTI_CPU, MULTI_GPU, FSDP and DEEPSPEED"
        )
    return out


def _acc_precision(acc: Mapping[str, Any], kind: str, source: str, out: dict[str, Any],
                   dropped: list[str]) -> None:
    """`mixed_precision` (a DeepSpeed JSON's own setting wins) and `use_cpu`."""
    mp = str(acc.get("mixed_precision", "no"))
    if mp not in _ACC_PRECISION:
        raise ConfigError(
            f"{source}: mixed_precision: {mp!r} is not supported; choose one of: no, fp16, bf16"
        )
    if "precision" in out and kind == "DEEPSPEED":
        if out["precision"] != _ACC_PRECISION[mp]:
            dropped.append(f"mixed_precision ({mp}: the DeepSpeed config file decides)")
    else:
        out["precision"] = _ACC_PRECISION[mp]
    if _flag(acc.get("use_cpu", False), f"{source}: use_cpu"):
        out["cpu"] = True


def _acc_launch(acc: Mapping[str, Any], kind: str, source: str) -> tuple[dict[str, Any], int]:
    """The machines and processes: our `launch` section, and the processes of all machines."""
    launch: dict[str, Any] = {}
    nodes = int(acc.get("num_machines") or 1)
    total = int(acc.get("num_processes") or 1)
    if kind == "NO":
        total = 1
    if total % nodes:
        raise ConfigError(f"{source}: num_processes={total} is not a multiple of num_machines={nodes}")
    launch["num_processes"] = total // nodes  # Accelerate counts all machines' processes
    launch["num_nodes"] = nodes
    launch["node_rank"] = int(acc.get("machine_rank") or 0)
    if acc.get("main_process_ip"):
        launch["main_address"] = str(acc["main_process_ip"])
    if acc.get("main_process_port"):
        launch["main_port"] = int(acc["main_process_port"])
    if acc.get("rdzv_backend") in ("static", "c10d"):
        launch["rdzv_backend"] = acc["rdzv_backend"]
    return launch, total


def _acc_parallelism(acc: Mapping[str, Any], kind: str, total: int, source: str, out: dict[str, Any]) -> None:
    """`parallelism_config`: its sizes fill the `parallelism` section, over HYBRID_SHARD's node
    default."""
    where = f"{source}: parallelism_config"
    section = from_parallelism(acc["parallelism_config"], total if "num_processes" in acc else None, where)
    if section is None:
        return
    if section.get("dp_shard", 1) > 1 and kind != "FSDP":
        raise ConfigError(f"{where}: dp_shard_size > 1 shards the model, which Accelerate does under "
                          f"distributed_type FSDP only (found {kind})")
    out.pop("shard_group_size", None)
    out["parallelism"] = section


def from_parallelism(sizes: Mapping[str, Any], num_processes: int | None = None,
                     source: str = "parallelism_config") -> dict[str, Any] | None:
    """Accelerate's `ParallelismConfig` sizes -> shardwise's `parallelism` section
    (`config.parallelism`): dp_replicate, dp_shard and tp by their own names, or None where they
    ask for nothing (every size 1, as Accelerate's defaults). The section holds only what was set:
    tp and cp above 1 (a size of 1 is left implied, so it yields to `tensor_parallel_size` and
    the like), both data-parallel sizes where either is above 1.

    `sizes` holds its fields by name (`dp_replicate_size`, `dp_shard_size`, `tp_size`, ...) or
    as an Accelerate YAML's `parallelism_config` section spells them (`parallelism_config_`
    before each). The product of the sizes must be the process count (`num_processes`, when
    known). cp_size is context parallelism's cp (a ring, as Accelerate's is); sp_size the same
    dimension with Ulysses (Accelerate runs it through DeepSpeed's; shardwise its own: the
    section's cp_method "ulysses").
    """
    plain = {str(k).removeprefix("parallelism_config_"): v for k, v in sizes.items() if v is not None}

    def size(name: str) -> int:
        value = _number(plain.get(name, 1), f"{source}: {name}")
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: {name}: expected an integer >= 1, found {value!r}")
        return value

    replicas, shard, tp, cp = (size(n) for n in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"))
    sp = size("sp_size")
    if sp > 1 and cp > 1:
        raise ConfigError(f"{source}: cp_size={cp} and sp_size={sp}: one context-parallel dimension at a "
                          "time (cp_size: a ring; sp_size: Ulysses); set one of them to 1")
    method: dict[str, Any] = {"cp_method": "ulysses"} if sp > 1 else {}
    cp = max(cp, sp)  # (sp_size: Ulysses over the same cp dimension; its sp_backend's name is not needed)
    if replicas * shard * tp * cp == 1:
        return None
    if num_processes is not None and replicas * shard * tp * cp != num_processes:
        raise ConfigError(f"{source}: dp_replicate_size={replicas} x dp_shard_size={shard} x tp_size={tp} "
                          f"{f'x cp_size={cp} ' if cp > 1 else ''}must equal the {num_processes} processes "
                          "(num_processes)")
    if replicas > 1 and shard == 1:
        raise ConfigError(f"{source}: dp_replicate_size={replicas} with dp_shard_size=1 is pure data "
                          "parallelism, which Accelerate refuses here too; use strategy ddp instead")
    # only what the user set (a size above 1, Ulysses): a field left out is implied and yields to
    # another spelling of it (`tensor_parallel_size`, ...), where a written 1 would have to agree.
    # Accelerate's cp is a ring (shardwise's default method); its sp is Ulysses (cp_method).
    section: dict[str, Any] = {"tp": tp} if tp > 1 else {}
    section.update({"cp": cp, **method} if cp > 1 else {})
    if replicas == shard == 1:
        return section  # the data-parallel ranks: the rest, laid out as the strategy does
    return {"dp_replicate": replicas, "dp_shard": shard, **section}  # (no other spelling: both, as given)


_FSDP_HYBRID = ("4", "5", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# FSDP1 switches FSDP2 (and so shardwise) always behaves as if they were set; what shardwise's
# checkpoints are (shards any world size loads); FSDP's own defaults.
_FSDP_NEUTRAL = {"sync_module_states": True, "use_orig_params": True, "state_dict_type": "SHARDED_STATE_DICT",
                 "limit_all_gathers": True, "backward_prefetch": "BACKWARD_PRE"}
_FSDP_NOTES = {
    "state_dict_type": "save_state writes shards that any world size and strategy load; save_model writes "
                       "the whole weights",
    "cpu_ram_efficient_loading": "shardwise: build the model under `init_empty()` or load it with "
                                 "from_pretrained, so each process allocates its shards only",
    "ignored_modules": "shardwise shards every module of the model",
    "auto_wrap_policy": "a callable policy: shardwise wraps the repeated blocks; name their classes in "
                        "transformer_cls_names_to_wrap",
}
_TORCH_DTYPES = {"torch.bfloat16": "bf16", "bfloat16": "bf16", "bf16": "bf16", "torch.float16": "fp16",
                 "float16": "fp16", "fp16": "fp16", "torch.float32": "fp32", "float32": "fp32"}


def _fsdp_strategy(plain: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`sharding_strategy` (FSDP1) or `reshard_after_forward` (FSDP2: a bool, or an FSDP1 name)
    -> the strategy, and hybrid sharding's node group."""
    out: dict[str, Any] = {"strategy": "zero3"}
    if "sharding_strategy" in plain:
        key = str(plain["sharding_strategy"]).upper()
        if key not in _FSDP_SHARDING:
            raise ConfigError(
                f"{source}: fsdp_config.sharding_strategy: {plain['sharding_strategy']!r} is not valid; "
                "choose 1-5 or FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2"
            )
        out["strategy"] = _FSDP_SHARDING[key]
        if key in _FSDP_HYBRID:  # FSDP's hybrid shards within a node; a parallelism_config may say otherwise
            out["shard_group_size"] = "node"
    if "reshard_after_forward" in plain:
        value = plain["reshard_after_forward"]
        flag = _flag(value, f"{source}: fsdp_config.reshard_after_forward") if not (
            isinstance(value, str) and value.upper() in _FSDP_SHARDING) else None
        out["strategy"] = (
            ("zero3" if flag else "zero2") if flag is not None else _FSDP_SHARDING[str(value).upper()]
        )
        if flag is None and str(value).upper() in _FSDP_HYBRID:
            out["shard_group_size"] = "node"
    return out


def acc_fsdp(cfg: Mapping[str, Any], dropped: list[str], source: str) -> dict[str, Any]:
    """An Accelerate YAML's `fsdp_config` (or a FullyShardedDataParallelPlugin's fields spelled the
    same way: `accelerate.plugins.fsdp_fields`) -> shardwise settings; what is not applied is
    appended to `dropped`, with why where it helps."""
    plain = {k.removeprefix("fsdp_"): v for k, v in cfg.items()}
    out = _fsdp_strategy(plain, source)
    if _flag(plain.get("offload_params", False), f"{source}: fsdp_config.offload_params"):
        out["offload"] = "params"
    if _flag(plain.get("activation_checkpointing", False), f"{source}: fsdp_config.activation_checkpointing"):
        out["activation_checkpointing"] = True
    policy = str(plain.get("auto_wrap_policy", "")).upper()
    layers = plain.get("transformer_layer_cls_to_wrap")
    if layers and policy in ("", "TRANSFORMER_BASED_WRAP"):
        names = layers if isinstance(layers, list) else str(layers).split(",")
        out["wrap"] = [n.strip() for n in names if n.strip()]
    if _flag(plain.get("activation_checkpointing_offload", False),
             f"{source}: fsdp_config.activation_checkpointing_offload"):
        out["activation_checkpointing"] = "offload"  # the saved activations kept on the host
    mp = plain.get("mixed_precision_policy")
    if mp is not None and str(mp) in _TORCH_DTYPES:
        out["precision"] = _TORCH_DTYPES[str(mp)]
    handled = {"sharding_strategy", "reshard_after_forward", "offload_params", "activation_checkpointing",
               "activation_checkpointing_offload", "transformer_layer_cls_to_wrap", "version"}
    if mp is not None and str(mp) in _TORCH_DTYPES:
        handled.add("mixed_precision_policy")
    if policy in ("", "NO_WRAP", "TRANSFORMER_BASED_WRAP"):
        handled.add("auto_wrap_policy")
    for key, value in plain.items():
        if key == "min_num_params" or (key == "auto_wrap_policy" and policy == "SIZE_BASED_WRAP"):
            dropped.append(f"fsdp_config.{key} (size-based wrapping: shardwise wraps the repeated blocks)")
        elif key not in handled and value and _FSDP_NEUTRAL.get(key, object()) != value:
            note = _FSDP_NOTES.get(key)
            dropped.append(f"fsdp_config.{key}" + (f"={value} ({note})" if note else ""))
    return out


def _acc_deepspeed(cfg: Mapping[str, Any], dropped: list[str], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cfg.get("deepspeed_config_file"):
        out["deepspeed_config"] = str(cfg["deepspeed_config_file"])
    stage = cfg.get("zero_stage")
    if stage is not None:
        if stage not in _ZERO_STAGES:
            raise ConfigError(f"{source}: deepspeed_config.zero_stage: expected 0-3, found {stage!r}")
        out["strategy"] = _ZERO_STAGES[stage]
    if str(cfg.get("offload_param_device", "none")).lower() == "cpu":
        out["offload"] = "params"
    elif str(cfg.get("offload_optimizer_device", "none")).lower() == "cpu":
        out["offload"] = "optimizer"
    for dev in ("offload_param_device", "offload_optimizer_device"):
        if str(cfg.get(dev, "none")).lower() == "nvme":
            raise ConfigError(f"{source}: deepspeed_config.{dev}: 'nvme' is not supported; use cpu")
    if cfg.get("gradient_accumulation_steps") not in (None, "auto"):
        out["grad_accum_steps"] = int(cfg["gradient_accumulation_steps"])
    if cfg.get("gradient_clipping") not in (None, "auto"):
        out["max_grad_norm"] = float(cfg["gradient_clipping"]) or None
    handled = {"deepspeed_config_file", "zero_stage", "offload_param_device", "offload_optimizer_device",
               "gradient_accumulation_steps", "gradient_clipping"}
    dropped += [f"deepspeed_config.{k}" for k in cfg if k not in handled]
    return out


def from_dynamo(fields: Mapping[str, Any], source: str = "dynamo_config") -> tuple[dict[str, Any], list[str]]:
    """Accelerate's torch.compile settings -> (compile settings, notes on what differs).

    `fields`: a `TorchDynamoPlugin`'s fields (backend, mode, fullgraph, dynamic, options, disable,
    use_regional_compilation) or an Accelerate YAML's `dynamo_config` (the same, spelled
    `dynamo_backend`, `dynamo_mode`, `dynamo_use_fullgraph`, ...). Backend NO (or disable) compiles
    nothing; any other backend compiles each block, named in lower case (the config checks torch
    has it). Backend options are refused: shardwise passes none. Accelerate without regional
    compilation compiles the whole model; shardwise compiles the blocks either way (a note says so).
    """
    plain = {str(k).removeprefix("dynamo_").removeprefix("use_"): v for k, v in fields.items()}
    backend = plain.get("backend")
    name = str(getattr(backend, "value", backend) or "no").lower()  # a DynamoBackend member or its name
    if name == "no" or _flag(plain.get("disable", False), f"{source}: disable"):
        return {}, []
    if plain.get("options"):
        raise ConfigError(f"{source}: options={plain['options']!r}: shardwise passes no backend options to "
                          "torch.compile; drop them (mode, fullgraph and dynamic are taken)")
    mode = plain.get("mode")
    fullgraph = _flag(plain.get("fullgraph", False), f"{source}: fullgraph")
    out: dict[str, Any] = {"compile": True, "compile_backend": name,
                           "compile_mode": None if mode in (None, "default") else str(mode),
                           "compile_fullgraph": bool(fullgraph),
                           "compile_dynamic": _flag(plain.get("dynamic"), f"{source}: dynamic")}
    notes = []
    if not _flag(plain.get("regional_compilation", False), f"{source}: use_regional_compilation"):
        notes.append("use_regional_compilation (false: Accelerate compiles the whole model; shardwise "
                     "compiles each block, the rest runs eagerly)")
    return out, notes
