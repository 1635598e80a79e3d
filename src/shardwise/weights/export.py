"""Full weights out: safetensors files (split above a size, with an index) plus config.json.

One writer serves `Engine.save_model` (live, gathered weights) and `shardwise export` (a
training checkpoint read offline), so both produce the same files, byte for byte.

The target folder is the user's: it may already hold a tokenizer, a results file or an earlier
export. The writer adds or replaces only its own names (config.json, model.safetensors, or the
shards and model.safetensors.index.json), one file at a time through a staging folder beside the
target (see `storage`), the index (or the single file) last. Files of an earlier save that the
new one does not rewrite are removed only when shardwise wrote them; an earlier model.safetensors
that shardwise did not write, and that would shadow new sharded weights, is refused before
anything is written.

Checksums: each safetensors file records in its header's metadata the checksum of its tensor
entries (names, dtypes, shapes, offsets) and data, and the top file (model.safetensors, or the
index) records the checksums of the others (the shards, config.json), so a flipped byte, a
truncated file or a mix of two saves is found by `verify_model_dir`. The files are written here,
not by `safetensors.torch.save_file`, whose metadata order varies from process to process: these
are byte-identical for the same weights (save_model and export agree), streamed from the tensors
without a serialized copy, laid out as safetensors lays them out (wider dtypes first).
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from .storage import (
    ALGORITHM,
    CheckpointError,
    check_file,
    checksum_file,
    fsync_path,
    new_staging,
    os_error_line,
)

_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30
}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_FILES_KEY = "shardwise_files"  # in the top file: checksums of the other files of the save
SAFETENSORS_KEY = "shardwise_checksum"  # in each safetensors header: its own entries' and data's
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
_SIZES = {name: torch.empty((), dtype=dt).element_size() for dt, name in _DTYPES.items()}


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


def hf_config_json(module: torch.nn.Module) -> str | None:
    """A `transformers` model's config.json text; None for other modules."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) and hasattr(module, "save_pretrained") else None


# -- what is already in the folder ----------------------------------------------------------------
def _ours_safetensors(path: Path) -> bool:
    try:
        header, _ = read_safetensors_header(path)
    except CheckpointError:
        return False
    return SAFETENSORS_KEY in (header.get("__metadata__") or {})


def _read_index(folder: Path) -> dict[str, Any] | None:
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return index if isinstance(index, dict) and isinstance(index.get("weight_map"), dict) else None


def _stale_files(folder: Path, writing: set[str], sharded: bool) -> list[Path]:
    """Files of an earlier shardwise save in `folder` that the new save does not rewrite (they
    are removed once it is in place); CheckpointError for a file shardwise did not write that
    would shadow the new weights."""
    if not folder.is_dir():
        return []
    stale: list[Path] = []
    index = _read_index(folder)
    if index is not None and _FILES_KEY in (index.get("metadata") or {}):  # an index shardwise wrote
        for name in sorted(set(index["weight_map"].values()) - writing):
            if (folder / name).is_file() and _ours_safetensors(folder / name):
                stale.append(folder / name)
        if not sharded:
            stale.append(folder / INDEX)
    single = folder / SINGLE
    if sharded and single.is_file():  # from_pretrained would load it instead of the new shards
        if not _ours_safetensors(single):
            raise CheckpointError(
                f"{single}: was not written by shardwise and would shadow the sharded weights about to "
                "be written beside it (loaders read model.safetensors first); move it, or save elsewhere"
            )
        stale.append(single)
    return stale


# -- writing -----------------------------------------------------------------------------------
def _split(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
    return shards


def _entries_digest(entries: dict[str, Any]) -> xxhash.xxh3_64:
    """The checksum's start: the tensor entries (names, dtypes, shapes, offsets), canonically."""
    return xxhash.xxh3_64(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode())


def _write_shard(tensors: dict[str, torch.Tensor], path: Path, extra: dict[str, str]) -> str:
    """One safetensors file recording its own checksum in its header; returns that checksum."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # aligned, as safetensors does
    entries, offset, data = {}, 0, []
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"{path}: {name} has dtype {t.dtype}, which safetensors cannot store")
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy().data) if t.numel() else memoryview(b"")
        entries[name] = {
            "dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]
        }
        offset += len(raw)
        data.append(raw)
    h = _entries_digest(entries)
    for raw in data:
        h.update(raw)
    digest = f"{ALGORITHM}:{h.hexdigest()}"
    header = json.dumps({"__metadata__": {"format": "pt", SAFETENSORS_KEY: digest, **extra}, **entries},
                        sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for raw in data:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return digest


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the data section); CheckpointError if the file is not safetensors."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise ValueError(f"header length {n} is not plausible")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise TypeError("header is not a JSON object")
            return header, 8 + n
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None


def safetensors_checksum(path: Path) -> tuple[str | None, str]:
    """(checksum recorded in the header or None, checksum of the file as it is on disk)."""
    header, start = read_safetensors_header(path)
    recorded = (header.get("__metadata__") or {}).get(SAFETENSORS_KEY)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    end = start
    for name, e in entries.items():
        try:
            begin, stop = e["data_offsets"]
            numel = 1
            for d in e["shape"]:
                numel *= d
            if stop - begin != numel * _SIZES[e["dtype"]]:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the header entry of {name} is corrupted") from None
        end = max(end, start + stop)
    size = path.stat().st_size
    if end != size:
        raise CheckpointError(f"{path}: truncated or padded ({size} bytes, its header says {end})")
    h = _entries_digest(entries)
    if end > start:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            h.update(view[start:end])  # the data section, as laid out
            view.release()
    return recorded, f"{ALGORITHM}:{h.hexdigest()}"


def write_safetensors(
    state: dict[str, torch.Tensor],
    folder: Path,
    *,
    max_shard_size: int | str = "5GB",
    config_json: str | None = None,
) -> None:
    """Write `state` into `folder`: model.safetensors, or model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json above `max_shard_size`; config.json when given. Only these
    names are written or replaced; every other file in `folder` stays (see the module doc)."""
    folder = Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise CheckpointError(
            f"{folder}: is a file, not a folder; model weights are saved as a folder of files"
        )
    shards = _split(state, parse_size(max_shard_size))
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    sharded = len(shards) > 1
    writing = set(names) | ({INDEX} if sharded else set()) | ({CONFIG} if config_json is not None else set())
    stale = _stale_files(folder, writing, sharded)  # refuses before anything is written
    stage: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        stage = new_staging(folder)
        sums: dict[str, str] = {}
        if config_json is not None:
            (stage / CONFIG).write_text(config_json)
            fsync_path(stage / CONFIG)
            sums[CONFIG] = checksum_file(stage / CONFIG)
        if not sharded:
            _write_shard(shards[0], stage / SINGLE, {_FILES_KEY: json.dumps(sums, sort_keys=True)})
            order = [n for n in (CONFIG,) if n in sums] + [SINGLE]
        else:
            weight_map = {}
            for name, shard in zip(names, shards):
                sums[name] = _write_shard(shard, stage / name, {})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total, _FILES_KEY: sums}, "weight_map": weight_map}
            (stage / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            fsync_path(stage / INDEX)
            order = [*sorted(sums), INDEX]
        folder.mkdir(exist_ok=True)
        for name in order:  # the top file last: a reader sees the old save or the new one whole
            os.replace(stage / name, folder / name)
        fsync_path(folder)
        for path in stale:
            path.unlink()
        shutil.rmtree(stage)
    except BaseException as err:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if isinstance(err, OSError):
            raise CheckpointError(os_error_line(folder, "write the model files", err)) from None
        raise


def save_model_files(
    module: torch.nn.Module,
    state: dict[str, torch.Tensor],
    target: Path,
    *,
    max_shard_size: int | str = "5GB",
) -> None:
    """Consolidated weights of `module` (given as `state`) into the folder `target`."""
    write_safetensors(drop_aliases(state, find_aliases(module)), Path(target),
                      max_shard_size=max_shard_size, config_json=hf_config_json(module))


# -- reading back --------------------------------------------------------------------------------
def verify_model_dir(folder: Path) -> list[str]:
    """Check every file of the model save in `folder` against its recorded checksum; return the
    files checked. CheckpointError (one line, naming the file) on the first mismatch."""
    return [check() for check in model_dir_checks(folder)]


def written_by_shardwise(folder: Path) -> bool:
    """Whether the model save at `folder` (a folder or one .safetensors file) records checksums."""
    folder = Path(folder)
    top = folder if folder.is_file() else folder / SINGLE
    if top.is_file():
        return _ours_safetensors(top)
    index = _read_index(folder)
    return index is not None and _FILES_KEY in (index.get("metadata") or {})


def model_dir_checks(folder: Path) -> list[Callable[[], str]]:
    """One check per file of the model save at `folder`, each returning the file's name or
    raising CheckpointError; processes can share them out."""
    folder = Path(folder)
    if folder.is_file() and folder.suffix == ".safetensors":
        return [functools.partial(_verify_safetensors, folder, None)]
    index = _read_index(folder)
    if (folder / SINGLE).is_file():
        header, _ = read_safetensors_header(folder / SINGLE)
        top, recorded = folder / SINGLE, json.loads((header.get("__metadata__") or {}).get(_FILES_KEY, "{}"))
    elif index is not None:
        top, recorded = folder / INDEX, (index.get("metadata") or {}).get(_FILES_KEY)
        if recorded is None:
            raise CheckpointError(
                f"{top}: records no checksums (not written by shardwise); nothing to verify against"
            )
        for name in sorted(set(index["weight_map"].values()) - set(recorded)):
            raise CheckpointError(
                f"{top}: names {name} but records no checksum for it (altered after the save)"
            )
    else:
        raise CheckpointError(f"{folder}: holds no {SINGLE} and no {INDEX}: no model saved here")
    checks: list[Callable[[], str]] = []
    if top.name == SINGLE:
        checks.append(functools.partial(_verify_safetensors, top, None))
    for name, digest in sorted(recorded.items()):
        path = folder / name
        verify = _verify_safetensors if name.endswith(".safetensors") else _verify_plain
        checks.append(functools.partial(verify, path, digest))
    return checks


def _verify_plain(path: Path, expected: str) -> str:
    problem = check_file(path, expected)
    if problem:
        raise CheckpointError(problem)
    return path.name


def _verify_safetensors(path: Path, expected: str | None) -> str:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    recorded, actual = safetensors_checksum(path)
    if recorded is None:
        raise CheckpointError(
            f"{path}: records no checksum (not written by shardwise); nothing to verify against"
        )
    if actual != recorded:
        raise CheckpointError(
            f"{path}: checksum mismatch: its tensors were corrupted or altered after the save"
        )
    if expected is not None and actual != expected:
        raise CheckpointError(
            f"{path}: is not the file this save wrote (its checksum differs from the index's): "
            "a mix of two saves, or a replaced file"
        )
    return path.name
