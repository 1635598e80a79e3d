"""Config files in and out: YAML/JSON reading with file:line errors, key and type validation,
layering (defaults < DeepSpeed JSON < file < flags), and YAML output.

Validation is pydantic's, on the very dataclasses of `config/tree.py`; this module only turns its
findings into one line that names the file, the key, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import TypeAdapter, ValidationError

from .tree import FLAT_KEYS, ConfigError, EngineConfig, as_written, flat_spellings, nest, unknown_key


def field_names(cls: type) -> list[str]:
    """Names of a config dataclass's fields (used to suggest the closest valid key)."""
    return [f.name for f in dataclasses.fields(cls)]


_ADAPTER: TypeAdapter[EngineConfig] | None = None


def _adapter() -> TypeAdapter[EngineConfig]:
    global _ADAPTER
    if _ADAPTER is None:
        _ADAPTER = TypeAdapter(EngineConfig)
    return _ADAPTER


def read_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file as a dict; syntax errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: is not UTF-8 text (byte {err.start} is 0x{err.object[err.start]:02x}); "
                          "save it as UTF-8") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{p}:{err.lineno}: JSON syntax error: {err.msg}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{p}{line}: YAML syntax error: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of settings at the top, found {type(data).__name__}")
    return data


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside an annotation such as `X`, `X | None`."""
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def check_keys(data: Mapping[str, Any], cls: type, source: str, prefix: str = "") -> None:
    """Refuse unknown keys anywhere in the tree, suggesting the closest valid one."""
    hints = typing.get_type_hints(cls)
    valid = field_names(cls)
    for key, value in data.items():
        if key not in valid:
            raise ConfigError(f"{source}: {unknown_key(str(key), valid, prefix)}")
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, Mapping):
            check_keys(value, sub, source, f"{prefix}{key}.")


def _describe(errors: list[dict[str, Any]]) -> str:
    """One line from pydantic's errors: the key, what was expected, what was found."""
    first = errors[0]
    names = {f for cls in _all_config_classes() for f in field_names(cls)}
    path = [str(p) for p in first["loc"] if isinstance(p, str) and p in names]
    same = [e for e in errors if [str(p) for p in e["loc"] if isinstance(p, str) and p in names] == path]
    expected = " or ".join(dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in same))
    if first["type"] == "value_error":
        return str(first["msg"]).removeprefix("Value error, ")
    where = ".".join(path) or "config"
    return f"{where}: expected {expected}, found {first.get('input')!r}"


def _all_config_classes() -> list[type]:
    out: list[type] = []
    todo: list[type] = [EngineConfig]
    while todo:
        cls = todo.pop()
        out.append(cls)
        for hint in typing.get_type_hints(cls).values():
            sub = _dataclass_of(hint)
            if sub is not None and sub not in out:
                todo.append(sub)
    return out


def build(data: Mapping[str, Any], source: str = "config",
          spelled: Mapping[tuple[str, str], str] | None = None) -> EngineConfig:
    """Validate settings (sections, flat keys or both) into an `EngineConfig`. A refusal names
    the setting as it was written: by its flat key where `spelled` (`Layers.spelled`; default:
    the flat keys in `data`) holds it, else by its section's path."""
    spelled = flat_spellings(data) if spelled is None else spelled
    data = nest(data, source)
    check_keys(data, EngineConfig, source)
    try:
        return _adapter().validate_python(dict(data))
    except ValidationError as err:
        said = _describe([dict(e) for e in err.errors()])
        raise ConfigError(f"{source}: {as_written(said, spelled)}") from None
    except ConfigError as err:
        raise ConfigError(f"{source}: {as_written(str(err), spelled)}") from None


def merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, nested mappings merged key by key."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def looks_like_deepspeed(data: Mapping[str, Any]) -> bool:
    """A DeepSpeed JSON has keys of its own that no shardwise file has."""
    ds_only = {"zero_optimization", "train_micro_batch_size_per_gpu", "gradient_clipping",
               "gradient_accumulation_steps", "fp16", "bf16", "bfloat16"}
    return bool(ds_only & set(data))


def looks_like_accelerate(data: Mapping[str, Any]) -> bool:
    """An Accelerate config YAML (what `accelerate config` writes, `accelerate launch
    --config_file` reads) has keys of its own that no shardwise file has."""
    return bool({"distributed_type", "compute_environment"} & set(data))


class Layers(NamedTuple):
    """What `load_layers` read: the settings (nested), the DeepSpeed or Accelerate keys that have
    no equivalent here, and the settings the shardwise file and the flags gave by their flat keys
    (`flat_spellings`: how `build` names them in a refusal)."""

    data: dict[str, Any]
    dropped: list[str]
    spelled: dict[tuple[str, str], str]


def load_layers(path: str | Path | None, flags: Mapping[str, Any] | None = None) -> Layers:
    """The settings a file (and the DeepSpeed JSON it names) and flags give, unvalidated (see
    `Layers`). The file may be a shardwise YAML, a DeepSpeed JSON or an Accelerate YAML
    (translated as `shardwise config --from-accelerate` translates it)."""
    from .translate import from_accelerate, from_deepspeed

    data: dict[str, Any] = read_file(path) if path is not None else {}
    layered: dict[str, Any] = {}
    dropped: list[str] = []
    spelled = flat_spellings(flags or {})  # (a translated file's keys were written as no one's)
    if path is not None and looks_like_accelerate(data):
        here = Path(path).parent
        data, dropped = from_accelerate(data, source=str(path), read_json=lambda p: read_file(
            p if Path(p).is_absolute() else here / p))
        data.pop("deepspeed_config", None)  # (its JSON is translated in already)
        return Layers(merge(nest(data, str(path)), nest(flags or {}, "flags")), dropped, spelled)
    flags = nest(flags or {}, "flags")
    if path is not None and looks_like_deepspeed(data):  # a DeepSpeed JSON given as the config
        ds_path, data = str(path), {}
    else:
        spelled = {**flat_spellings(data), **spelled}
        data = nest(data, str(path))
        if path is not None:
            check_keys(data, EngineConfig, str(path))
        ds_path = (flags.get("sharding", {}).get("deepspeed_config")
                   or data.get("sharding", {}).get("deepspeed_config"))
    if ds_path:
        if path is not None and not Path(ds_path).is_absolute():
            candidate = Path(path).parent / ds_path
            ds_path = str(candidate) if candidate.is_file() else ds_path
        layered, dropped = from_deepspeed(read_file(ds_path), source=str(ds_path))
        layered = nest({**layered, "deepspeed_config": str(ds_path)}, str(ds_path))
    layered = merge(layered, data)
    layered = merge(layered, flags)
    return Layers(layered, dropped, spelled)


def load_config(path: str | Path | None, flags: Mapping[str, Any] | None = None) -> EngineConfig:
    """Defaults < DeepSpeed JSON < file < flags, validated."""
    data, _, spelled = load_layers(path, flags)
    return build(data, str(path) if path is not None else "flags", spelled)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain YAML-able data (classes in `wrap` become their names)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = [v.__name__ if isinstance(v, type) else v for v in value]
        elif callable(value):  # parallelize: a function by its "module:function" name
            value = f"{value.__module__}:{value.__qualname__}"
        out[f.name] = value
    return out


def to_yaml(cfg: EngineConfig) -> str:
    return str(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def write_yaml(cfg: EngineConfig, path: str | Path, *, header: str = "") -> None:
    """Write a resolved config atomically (a temporary file beside the target, then a rename).

    A DeepSpeed JSON it came from is already translated into every field, so the file names
    it in a comment only: read back, it means exactly what it says, wherever it is moved.
    """
    if cfg.sharding.deepspeed_config:
        header += f"# includes the settings of {cfg.sharding.deepspeed_config}\n"
        cfg = cfg.with_keys(deepspeed_config=None)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(header + to_yaml(cfg))
    tmp.replace(target)


def config_with_code(kwargs: dict[str, Any], path: str | Path | None) -> tuple[EngineConfig, list[str]]:
    """The launcher's resolved config at `path` (if any) with the keywords given in code on
    top, and the keys where the two disagree. A resolved file holds every field; one still at
    its default was not set by anyone, so code changing it is no conflict (the launcher's own
    file would otherwise warn on every run)."""
    data = load_layers(path).data if path else {}
    defaults = to_dict(EngineConfig())
    conflicts = []
    for k, v in kwargs.items():
        if k not in FLAT_KEYS or isinstance(v, dict):
            continue
        section, name = FLAT_KEYS[k]
        said = data.get(section, {}).get(name, defaults[section][name])
        if said != v and said != defaults[section][name]:
            conflicts.append(f"{k}={v!r} in code, {said!r} in {path}")
    return build(merge(data, nest(kwargs, "Engine()")), str(path) if path else "Engine()"), conflicts
