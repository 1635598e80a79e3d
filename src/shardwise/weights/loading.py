"""Pretrained weights in: safetensors files read straight into prepared (sharded) models.

`load_model` is the inverse of `save_model`. It reads a folder written by `save_model`, by
`shardwise export` or by `transformers`' `save_pretrained` (one `model.safetensors`, or shards
and `model.safetensors.index.json`), or a single `.safetensors` file. Everything is checked
from the files' headers before any weight changes: every key the model needs is there, none is
left over, every shape matches, no file is truncated (and a save written by shardwise matches
its checksums, each process verifying a share of the files). Then each process reads only what
it holds: the rows of its shard for a sharded (DTensor) parameter, the whole tensor for a
replica, converting the dtype on the way. Rows are read with plain positioned reads (a dim-0
slice is one contiguous byte range), not through a memory map, whose touched pages would count
in every process's resident memory. Tied weights (an output head sharing the input embedding)
are one tensor, stored once.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed.internals import is_strided, local_part, local_tensor, shard_box
from .export import (
    INDEX,
    SINGLE,
    find_aliases,
    model_dir_checks,
    read_safetensors_header,
    written_by_shardwise,
)
from .storage import CheckpointError, agree

log = logging.getLogger("shardwise")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

class Reader:
    """Reads a model key's tensor from the files: `read(key, rows)` (rows None: all of it), or
    `read(key, rows, out)` into a tensor of the file's dtype (`read.dtype(key)`)."""

    def __init__(self, read: Callable[[str, slice | None, torch.Tensor | None], torch.Tensor],
                 dtype: Callable[[str], torch.dtype]) -> None:
        self._read, self.dtype = read, dtype

    def __call__(self, key: str, rows: slice | None, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._read(key, rows, out)


@dataclass(frozen=True, slots=True)
class _Entry:
    file: Path
    key: str  # the key in the file
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    parts: tuple[tuple[_Entry, ...], ...] = ()
    """a fused experts tensor the file stores expert by expert: per expert (its dim-0 row), the
    entries laid end to end along the expert's first dimension (`fuse_experts`)"""

    def file_keys(self) -> list[str]:
        """The file keys this entry reads."""
        return [p.key for row in self.parts for p in row] if self.parts else [self.key]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model save (a folder or one file); one line if there are none."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a .safetensors file; give a folder written by save_model, "
                                  "shardwise export or save_pretrained, or a .safetensors file")
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    if (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_text())
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path / INDEX}: not a safetensors index ({err})") from None
        for name in files:
            if not (path / name).is_file():
                raise CheckpointError(f"{path / name}: missing (named in {INDEX})")
        return [path / name for name in files]
    found = ", ".join(sorted(p.name for p in path.iterdir())[:4]) or "nothing"
    raise CheckpointError(
        f"{path}: holds no {SINGLE} and no {INDEX} (found {found}): not a safetensors model save"
    )


def read_entries(files: list[Path]) -> dict[str, _Entry]:
    """Every tensor the files hold, from their headers (a truncated file is refused here)."""
    entries: dict[str, _Entry] = {}
    for f in files:
        header, start = read_safetensors_header(f)
        size = f.stat().st_size
        for key, e in header.items():
            if key == "__metadata__":
                continue
            try:
                end = start + int(e["data_offsets"][1])
                entry = _Entry(f, key, str(e["dtype"]), tuple(int(d) for d in e["shape"]),
                               start + int(e["data_offsets"][0]))
            except (KeyError, TypeError, ValueError, IndexError):
                raise CheckpointError(f"{f}: the header entry of {key} is corrupted") from None
            if end > size:
                raise CheckpointError(f"{f}: truncated ({size} bytes; {key} ends at byte {end})")
            if entry.dtype not in _DTYPES:
                raise CheckpointError(f"{f}: {key} has dtype {entry.dtype}, which shardwise cannot load")
            entries[key] = entry
    return entries


def class_name(module: nn.Module) -> str:
    """The user's class name (FSDP2 renames a sharded module's class to FSDP<name>)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next(b for b in cls.__bases__ if b is not FSDPModule)
    return cls.__name__


def _few(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")


def full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """State-dict key -> the tensor's full shape (a DTensor's global shape)."""
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


# prefixes a wrapper adds to every key of the module it wraps, and who adds them
WRAPPER_PREFIXES = {
    "module.": "DDP or DataParallel",
    "_orig_mod.": "torch.compile",
    "_fsdp_wrapped_module.": "FSDP",
    "_checkpoint_wrapped_module.": "activation checkpointing",
    "model.": "a wrapper module",
}
_LEADING = ("module.", "model.")  # only at the front; the others sit at any depth
KEY_MAP_HINT = "rename them with key_map={'<prefix in the file>.': '<prefix in the model>.'}"


def _candidates(key: str, prefix: str) -> tuple[str, ...]:
    """File keys that may hold model key `key` (with or without transformers' base-model prefix)."""
    return (key, key.removeprefix(prefix + "."), f"{prefix}.{key}") if prefix else (key,)


def _find(shapes: dict[str, tuple[int, ...]], entries: dict[str, _Entry], prefix: str) -> dict[str, _Entry]:
    found: dict[str, _Entry] = {}
    for key in shapes:
        for candidate in _candidates(key, prefix):
            if candidate in entries:
                found[key] = entries[candidate]
                break
    return found


def rename(entries: dict[str, _Entry], key_map: Mapping[str, str]) -> dict[str, _Entry]:
    """File keys renamed by `key_map` (prefix in the file -> prefix in the model; the first
    that matches applies)."""
    out: dict[str, _Entry] = {}
    for key, entry in entries.items():
        for old, new in key_map.items():
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = entry
    return out


def _strip(key: str, wrapper: str) -> str:
    return key.removeprefix(wrapper) if wrapper in _LEADING else key.replace(wrapper, "")


def strip_wrappers(shapes: dict[str, tuple[int, ...]], entries: dict[str, _Entry], prefix: str,
                   source: Path) -> dict[str, _Entry]:
    """Keys saved from a wrapped model (`module.` from DDP, `_orig_mod.` from torch.compile,
    nested too) lose the wrappers' prefixes, only where that makes more of them match (a Llama's
    own `model.` stays); one line says so."""
    best, best_count = entries, len(_find(shapes, entries, prefix))
    stripped: tuple[str, ...] = ()
    if best_count == len(entries):
        return entries
    frontier: list[tuple[dict[str, _Entry], tuple[str, ...]]] = [(entries, ())]
    for _ in range(3):  # up to three wrappers deep (DDP around torch.compile around FSDP)
        grown = []
        for state, done in frontier:
            for wrapper in WRAPPER_PREFIXES:
                trial = {_strip(k, wrapper): e for k, e in state.items()}
                if len(trial) == len(state) and trial.keys() != state.keys():
                    grown.append((trial, (*done, wrapper)))
                    count = len(_find(shapes, trial, prefix))
                    if count > best_count:
                        best, best_count, stripped = trial, count, (*done, wrapper)
        frontier = grown
    if stripped:
        log.warning("%s: its keys carry the prefix%s %s (saved from a model wrapped by %s): stripped",
                    source, "es" if len(stripped) > 1 else "", ", ".join(f"'{w}'" for w in stripped),
                    ", ".join(WRAPPER_PREFIXES[w] for w in stripped))
    return best


# a mixture-of-experts layer's experts stored one by one, as transformers 5 writes them and fuses
# them as it loads (its conversion_mapping's "mixtral" and "qwen2_moe" layouts, which most MoE
# model types share): per fused tensor, the per-expert names laid end to end along each expert's
# first dimension, in either naming; Mixtral's files also call the layer `block_sparse_moe`
_FUSED_FROM = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
               "down_proj": (("w2",), ("down_proj",))}
_MOE_RENAME = (".block_sparse_moe.", ".mlp.")


def fuse_experts(shapes: dict[str, tuple[int, ...]], entries: dict[str, _Entry]) -> dict[str, _Entry]:
    """`entries` with each fused experts tensor the model has (`...experts.gate_up_proj` [E, 2I, H],
    `...experts.down_proj` [E, H, I]) and the files store expert by expert made one entry that
    reads those (the per-expert entries it replaces removed); the files' own `block_sparse_moe`
    layer named as the model names it. Nothing changes where the files hold the fused tensors."""
    old, new = _MOE_RENAME
    if any(old in k for k in entries) and not any(old in k for k in shapes):
        entries = {k.replace(old, new): e for k, e in entries.items()}
    out = dict(entries)
    for key, shape in shapes.items():
        head, _, name = key.rpartition(".")
        if name not in _FUSED_FROM or not head.endswith("experts") or key in entries or not shape:
            continue
        for names in _FUSED_FROM[name]:
            rows = [[f"{head}.{e}.{n}.weight" for n in names] for e in range(shape[0])]
            if all(k in entries for row in rows for k in row):
                out[key] = _fused(key, tuple(tuple(entries[k] for k in row) for row in rows))
                for k in (k for row in rows for k in row):
                    del out[k]
                break
    return out


def _fused(key: str, parts: tuple[tuple[_Entry, ...], ...]) -> _Entry:
    """The entry of a fused experts tensor read from its per-expert `parts` (one line if they do
    not line up: dtypes, or shapes that are not [rows, columns] alike for every expert)."""
    first = parts[0]
    kinds = {(p.dtype, len(p.shape), p.shape[1:]) for row in parts for p in row}
    if len(kinds) != 1 or len(first[0].shape) != 2 or any(
            [p.shape for p in row] != [p.shape for p in first] for row in parts):
        seen = sorted({f"{p.key} {p.dtype} {list(p.shape)}" for row in parts for p in row})
        raise CheckpointError(f"{first[0].file}: the experts behind {key} differ in dtype or shape "
                              f"({_few(seen)})")
    shape = (len(parts), sum(p.shape[0] for p in first), first[0].shape[1])
    return _Entry(first[0].file, f"{key} (from {first[0].key}, ...)", first[0].dtype, shape, 0, parts)


def match_keys(
    module: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    entries: dict[str, _Entry],
    source: Path,
    *,
    strict: bool,
    key_map: Mapping[str, str] | None = None,
    fills_missing: bool = False,
) -> dict[str, _Entry]:
    """Model key -> file entry, after checking names and shapes; one line naming the keys.

    Strict (the default, as torch's load_state_dict): a model tensor the files lack, or a file
    tensor nothing uses, is refused. `fills_missing`: the model initializes what the files lack
    (from_pretrained, as transformers does): those are listed in a warning, not refused, unless
    no key matches at all.
    """
    aliases = find_aliases(module)
    prefix = getattr(module, "base_model_prefix", "") or ""
    if key_map:
        entries = rename(entries, key_map)
    entries = strip_wrappers(shapes, entries, prefix, source)
    entries = fuse_experts(shapes, entries)
    found = _find(shapes, entries, prefix)
    missing = [k for k in shapes if k not in found and not (k in aliases and aliases[k] in found)]
    used = {k for e in found.values() for k in e.file_keys()}
    ignore = [re.compile(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for e in entries.values() for k in e.file_keys()
                        if k not in used and not any(p.search(k) for p in ignore))
    shaped = [
        f"{k} {list(found[k].shape)} vs {list(shapes[k])}"
        for k in shapes
        if k in found and found[k].shape != shapes[k]
    ]
    problems = []
    if shaped:
        problems.append("mis-shaped " + _few(shaped))
    if strict and (not fills_missing or not found) and missing:
        problems.append(f"missing {_few(missing)}" + (" (no key matches)" if not found else ""))
    if strict and unexpected:
        problems.append("unexpected " + _few(unexpected))
    if problems:
        hint = "" if shaped else (
            f" (another model's weights, or keys under another prefix? {KEY_MAP_HINT}, or load with "
            "strict=False to skip them)"
        )
        raise CheckpointError(f"{source}: does not match {class_name(module)}: {'; '.join(problems)}{hint}")
    if missing or unexpected:
        fate = "initialized by the model" if fills_missing else "left as they were"
        notes = [f"{fate}: {_few(missing)}"] * bool(missing)
        notes += [f"not used: {_few(unexpected)}"] * bool(unexpected)
        log.warning("%s: %s", source, "; ".join(notes))
    return {k: e for k, e in found.items() if k not in aliases or aliases[k] not in found}


def verify_shared(path: Path, rank: int, world: int) -> None:
    """A save written by shardwise is checked against its checksums, each process a share of
    its files (a collective); others have none to check."""
    problem = None
    if written_by_shardwise(path):
        try:
            for check in model_dir_checks(path)[rank::world]:
                check()
        except CheckpointError as err:
            problem = str(err)
    agree(problem)


def make_reader(found: dict[str, _Entry]) -> Reader:
    """Reads `key` (the rows asked for, or all) from its file; into `out` when given (a
    contiguous tensor of the file's dtype and the rows' shape), else into a new tensor."""

    def read(key: str, rows: slice | None, out: torch.Tensor | None = None) -> torch.Tensor:
        return _read_entry(found[key], rows, out)

    def file_dtype(key: str) -> torch.dtype:
        return _DTYPES[found[key].dtype]

    return Reader(read, file_dtype)


def _read_entry(entry: _Entry, rows: slice | None, out: torch.Tensor | None) -> torch.Tensor:
    """The rows of `entry` (all: None) into `out` or a new tensor of the file's dtype."""
    if entry.parts:
        return _read_fused(entry, rows, out)
    dtype = _DTYPES[entry.dtype]
    shape = list(entry.shape)
    row_bytes = torch.empty((), dtype=dtype).element_size()
    for d in shape[1:]:
        row_bytes *= d
    first = 0
    if rows is not None and shape:
        first, stop, _ = rows.indices(shape[0])
        shape[0] = max(0, stop - first)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    if out.numel():
        buf = memoryview(out.view(-1).view(torch.uint8).numpy().data)
        with open(entry.file, "rb", buffering=0) as f:
            f.seek(entry.offset + first * row_bytes)
            got = 0
            while got < len(buf):  # a raw read may return less than asked
                n = f.readinto(buf[got:])
                if not n:
                    raise CheckpointError(f"{entry.file}: truncated while reading {entry.key}")
                got += n
    return out


def _read_fused(entry: _Entry, rows: slice | None, out: torch.Tensor | None) -> torch.Tensor:
    """Experts `rows` of a fused experts tensor, each expert's parts read whole into its row (a
    rank reads the files of its own experts only)."""
    first, stop, _ = (rows or slice(None)).indices(entry.shape[0])
    if out is None:
        out = torch.empty((max(0, stop - first), *entry.shape[1:]), dtype=_DTYPES[entry.dtype])
    for e in range(first, stop):
        at = 0
        for part in entry.parts[e]:
            _read_entry(part, None, out[e - first, at : at + part.shape[0]])
            at += part.shape[0]
    return out


@torch.no_grad()
def copy_into(target: torch.Tensor, key: str, read: Reader) -> None:
    """Fill a prepared tensor from the files: a DTensor's local rows only, else all of it. Rows
    in the tensor's own dtype land straight in its memory (no copy held beside the shard)."""
    if isinstance(target, DTensor):
        shape, offset = shard_box(target)
        local = local_tensor(target)
        if local.numel() == 0:
            return
        if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(target.shape[1:]) or is_strided(target):
            # not a block of whole rows (a tp split by columns, a fused q/k/v's runs): read it
            # whole (one tensor at a time), keep this rank's part
            local.copy_(local_part(read(key, None), target).reshape(local.shape))
        else:
            _read_into(local, key, read, slice(offset[0], offset[0] + shape[0]))
    else:
        _read_into(target, key, read, None)


def _read_into(target: torch.Tensor, key: str, read: Reader, rows: slice | None) -> None:
    if target.is_contiguous() and target.device.type == "cpu" and read.dtype(key) == target.dtype:
        read(key, rows, target)
    else:
        target.copy_(read(key, rows).reshape(target.shape))


def check_source(path: str | os.PathLike[str], module: nn.Module, *, strict: bool,
                 shapes: dict[str, tuple[int, ...]] | None = None, key_map: Mapping[str, str] | None = None,
                 fills_missing: bool = False) -> tuple[Path, dict[str, _Entry]]:
    """Everything `load_model` checks before a weight changes (no collective). `shapes`: the
    full shapes of `module`'s tensors where the module no longer shows them (DeepSpeed)."""
    source = Path(path)
    entries = read_entries(weight_files(source))
    return source, match_keys(
        module,
        shapes or full_shapes(module),
        entries,
        source,
        strict=strict,
        key_map=key_map,
        fills_missing=fills_missing,
    )


@dataclass(frozen=True, slots=True)
class Pretrained:
    """On a model from `Engine.from_pretrained`: the weights `prepare` loads, and how."""

    path: Path
    strict: bool = True
    key_map: Mapping[str, str] | None = None

    def check(self, module: nn.Module) -> tuple[Path, dict[str, _Entry]]:
        """`check_source` for it: the model initializes what the files lack."""
        return check_source(self.path, module, strict=self.strict, key_map=self.key_map, fills_missing=True)
