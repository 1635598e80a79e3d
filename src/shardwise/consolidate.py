"""Full weights out: safetensors files (split above a size, with an index) plus config.json.

One writer serves `Engine.save_model` (live, gathered weights) and `shardwise export` (a
training checkpoint read offline), so both produce the same files, byte for byte.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'5GB', '500MiB', 1000 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"size {text!r} is not valid; write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


def drop_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """Keep one name per tied tensor (safetensors refuses shared storage; loaders re-tie)."""
    return {k: v for k, v in state.items() if k not in aliases}


def find_aliases(module: torch.nn.Module) -> dict[str, str]:
    """name -> the first name of the same tensor, for tied parameters (input/output embeddings)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


def swap_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished folder `tmp` to `target`; an existing `target` is set aside first and
    removed only after the rename, so at every moment one complete version exists."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A temporary folder beside `target` that replaces it only once everything is written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".incomplete", dir=target.parent))
    try:
        yield tmp
        swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_safetensors(
    state: dict[str, torch.Tensor],
    folder: Path,
    *,
    max_shard_size: int | str = "5GB",
    config_json: str | None = None,
) -> None:
    """Write `state` into `folder`: model.safetensors, or model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json above `max_shard_size`; config.json when given."""
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config_json is not None:
        (folder / "config.json").write_text(config_json)


def hf_config_json(module: torch.nn.Module) -> str | None:
    """A `transformers` model's config.json text; None for other modules."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) and hasattr(module, "save_pretrained") else None


def save_model_files(
    module: torch.nn.Module, state: dict[str, torch.Tensor], target: Path, *, max_shard_size: int | str = "5GB"
) -> None:
    """Consolidated weights of `module` (given as `state`) into `target`, atomically."""
    with atomic_dir(Path(target)) as tmp:
        write_safetensors(drop_aliases(state, find_aliases(module)), tmp,
                          max_shard_size=max_shard_size, config_json=hf_config_json(module))
