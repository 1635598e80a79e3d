"""Accelerate's plugin objects and its launcher's variables, read as shardwise settings.

One code path for a YAML key, a launcher variable and a plugin field: each plugin is turned into
the section an Accelerate YAML holds (`fsdp_config`, a DeepSpeed JSON) and handed to the same
translator (`config.translate`). Accelerate's own plugin classes read its launcher's variables
(`accelerate launch --config_file X.yaml` exports `ACCELERATE_USE_FSDP`, `FSDP_*`,
`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_*`, `PARALLELISM_CONFIG_*`), so a script that
passes no plugin under that launcher gets the plugin Accelerate would build, translated the same
way. Fields not applied are reported in one warning; contradictions (two plugins for two engines,
a plugin and a keyword that disagree) are refused in one line.

  DeepSpeedPlugin                   -> its DeepSpeed config (`plugin.deepspeed_config`, with
                                       `hf_ds_config` a path or a dict, "auto" values kept) through
                                       `from_deepspeed`; backend deepspeed unless the script says
  FullyShardedDataParallelPlugin    -> Accelerate's `fsdp_config` keys through the YAML's
                                       translator (`_acc_fsdp`)
  TorchTensorParallelPlugin         -> the `parallelism` section's tp
  deepspeed_plugins={name: plugin}  -> one plugin: as `deepspeed_plugin`; several: refused (every
                                       model of a shardwise run has the one strategy)
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from ..config.translate import acc_fsdp, from_deepspeed
from ..config.tree import ConfigError, strategy_spec

log = logging.getLogger("shardwise")

# DeepSpeed keys a plugin always writes that ask for nothing here (shardwise's save_model always
# writes whole weights, as stage3_gather_16bit_weights_on_model_save asks)
_DS_NEUTRAL = {"steps_per_print", "zero_optimization.stage3_gather_16bit_weights_on_model_save"}


def env_flag(name: str) -> bool:
    """A launcher variable that is a flag ("true", "1", "yes"), as Accelerate parses one."""
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def launcher_dynamo(kwargs: dict[str, Any]) -> None:
    """`ACCELERATE_DYNAMO_*` (a YAML's dynamo_config, exported by `accelerate launch`): the
    TorchDynamoPlugin Accelerate builds from them, when the script passes no compile setting."""
    if "dynamo_backend" in kwargs or "dynamo_plugin" in kwargs:
        return
    if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() in ("NO", ""):
        return
    from accelerate.utils import TorchDynamoPlugin  # type: ignore[import-untyped]

    kwargs["dynamo_plugin"] = TorchDynamoPlugin()  # reads ACCELERATE_DYNAMO_*


def _launcher_plugins(kwargs: dict[str, Any]) -> list[str]:
    """The plugins Accelerate builds from its launcher's variables when the script passes none
    (in `kwargs`, as if passed); the variables that did so, by name."""
    said = []
    if kwargs.get("deepspeed_plugin") is None and kwargs.get("deepspeed_plugins") is None \
            and env_flag("ACCELERATE_USE_DEEPSPEED"):
        from accelerate.utils import DeepSpeedPlugin

        kwargs["deepspeed_plugin"] = DeepSpeedPlugin()  # reads ACCELERATE_DEEPSPEED_*
        said.append("ACCELERATE_USE_DEEPSPEED")
    if kwargs.get("fsdp_plugin") is None and env_flag("ACCELERATE_USE_FSDP"):
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin()  # reads FSDP_*
        said.append("ACCELERATE_USE_FSDP")
    if kwargs.get("parallelism_config") is None and kwargs.get("torch_tp_plugin") is None \
            and env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        from accelerate import ParallelismConfig  # type: ignore[import-untyped]

        kwargs["parallelism_config"] = ParallelismConfig()  # reads PARALLELISM_CONFIG_*
        said.append("ACCELERATE_USE_PARALLELISM_CONFIG")
    return said


def read_plugins(kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Pop Accelerate's plugins (and the launcher's variables) from the Accelerator's `kwargs` and
    set their settings there; return those settings, by key (`kwargs` already holds them), and
    where they came from, in words (the start-up line and `shardwise env` say it)."""
    given = [n for n in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "torch_tp_plugin")
             if kwargs.get(n) is not None]
    launcher = _launcher_plugins(kwargs)
    many = kwargs.pop("deepspeed_plugins", None)
    ds = kwargs.pop("deepspeed_plugin", None)
    fsdp = kwargs.pop("fsdp_plugin", None)
    tp = kwargs.pop("torch_tp_plugin", None)
    if isinstance(ds, dict):  # Accelerate takes the dict under either name
        many, ds = ds, None
    if many is not None:
        if ds is not None:
            raise ConfigError("Accelerator(deepspeed_plugin=..., deepspeed_plugins=...): give one of them")
        if len(many) != 1:
            names = ", ".join(map(repr, many))
            raise ConfigError(f"Accelerator(deepspeed_plugins={{{names}}}): several DeepSpeed configs, one "
                              "per model, are not supported: every model of a shardwise run has the run's "
                              "strategy (a frozen model prepared for inference is sharded by it too); pass "
                              "one plugin")
        ds = next(iter(many.values()))
    if ds is not None and fsdp is not None:
        raise ConfigError("Accelerator(deepspeed_plugin=..., fsdp_plugin=...): two plugins for two engines "
                          f"(from {', '.join(launcher) or 'the script'}); give one of them")
    settings: dict[str, Any] = {}
    dropped: list[str] = []
    if ds is not None:
        settings.update(_deepspeed(ds, dropped))
    if fsdp is not None:
        settings.update(acc_fsdp(fsdp_fields(fsdp), dropped, "FullyShardedDataParallelPlugin"))
    if tp is not None:
        settings["parallelism"] = {"tp": int(tp.tp_size)}
    for key, value in settings.items():
        said = kwargs.get(key)
        if said is not None and said != value and not (key == "parallelism" and isinstance(said, dict)
                                                      and _agree(said, value)):
            raise ConfigError(f"Accelerator({key}={said!r}) and the Accelerate plugin's {key}={value!r} "
                              "disagree; drop one of them")
        if key == "parallelism" and isinstance(said, dict):
            value = {**value, **said}
        kwargs[key] = value
    if dropped:
        warnings.warn("Accelerate plugin fields shardwise does not apply: " + "; ".join(dropped),
                      stacklevel=3)
    sources = [f"Accelerator({n}=...)" for n in given] + [f"Accelerate's launcher ({v})" for v in launcher]
    return settings, ", ".join(sources)


def check_config_file(settings: dict[str, Any], source: str) -> None:
    """A plugin (or launcher variable) and the shardwise config file the launcher handed this
    worker (SHARDWISE_CONFIG) that disagree on a setting: refused in one line, naming both."""
    from ..config.files import config_with_code
    from ..distributed.world import config_source

    path = config_source()
    if not settings or not path:
        return
    _, conflicts = config_with_code(dict(settings), path)
    if conflicts:
        raise ConfigError(f"{source} and the config file disagree: {'; '.join(conflicts)}; drop one of them")


def announce(is_main: bool, message: str) -> None:
    """A start-up line on process 0's stderr (and in the log on every process)."""
    log.info(message)
    if is_main:
        print(f"shardwise: {message}", file=sys.stderr, flush=True)


def _agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _deepspeed(plugin: Any, dropped: list[str]) -> dict[str, Any]:
    """A DeepSpeedPlugin: its DeepSpeed config (Accelerate merged its fields and `hf_ds_config`
    into it) through the DeepSpeed JSON's translator, on backend deepspeed."""
    config = dict(plugin.deepspeed_config)
    out, more = from_deepspeed(config, source="DeepSpeedPlugin")
    dropped += [d for d in more if d not in _DS_NEUTRAL]
    out["backend"] = "deepspeed"
    if getattr(plugin, "zero3_init_flag", False) and strategy_spec(out.get("strategy", "ddp")).shards_params:
        dropped.append("zero3_init_flag (shardwise: build the model under `accelerator.engine.init_empty()`, "
                       "or load it with from_pretrained, to make each process allocate its shards only)")
    if getattr(plugin, "transformer_moe_cls_names", None):
        dropped.append(f"transformer_moe_cls_names={plugin.transformer_moe_cls_names!r} (DeepSpeed's leaf "
                       "modules for mixture-of-experts layers)")
    return out


def _name(value: Any) -> Any:
    """An enum member by its name (ShardingStrategy.FULL_SHARD -> "FULL_SHARD"); anything else as is."""
    return getattr(value, "name", value)


def fsdp_fields(plugin: Any) -> dict[str, Any]:
    """A FullyShardedDataParallelPlugin's fields as an Accelerate YAML's `fsdp_config` spells them
    (after the plugin's own normalisation: enums, policies, offload objects)."""
    out: dict[str, Any] = {"version": getattr(plugin, "fsdp_version", 1)}
    if plugin.sharding_strategy is not None:
        out["sharding_strategy"] = _name(plugin.sharding_strategy)
    elif plugin.reshard_after_forward is not None:
        rs = plugin.reshard_after_forward
        out["reshard_after_forward"] = rs if isinstance(rs, bool) else _name(rs)
    offload = plugin.cpu_offload
    out["offload_params"] = bool(getattr(offload, "offload_params", False)
                                 or type(offload).__name__ == "CPUOffloadPolicy" or offload is True)
    policy: Callable[..., Any] | str | None = plugin.auto_wrap_policy
    name = getattr(policy, "__name__", policy)
    if name in ("transformer_auto_wrap_policy", "size_based_auto_wrap_policy"):
        out["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP" if name[0] == "t" else "SIZE_BASED_WRAP"
    elif callable(policy):
        out["auto_wrap_policy"] = "a callable"
    if plugin.transformer_cls_names_to_wrap:
        out["transformer_layer_cls_to_wrap"] = list(plugin.transformer_cls_names_to_wrap)
    if plugin.min_num_params:
        out["min_num_params"] = plugin.min_num_params
    out["activation_checkpointing"] = bool(plugin.activation_checkpointing)
    if getattr(plugin, "activation_checkpointing_offload", False):
        out["activation_checkpointing_offload"] = True
    mp = plugin.mixed_precision_policy
    if mp is not None:
        out["mixed_precision_policy"] = str(getattr(mp, "param_dtype", mp))
    out["state_dict_type"] = _name(plugin.state_dict_type)
    for key in ("cpu_ram_efficient_loading", "ignored_modules", "sync_module_states", "forward_prefetch",
                "use_orig_params", "param_init_fn", "backward_prefetch"):
        value = getattr(plugin, key, None)
        if value:
            out[key] = _name(value)
    if getattr(plugin, "limit_all_gathers", True) is False:
        out["limit_all_gathers"] = False
    return out
