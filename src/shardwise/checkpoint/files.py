"""A checkpoint folder as files: its format, the checks before a load, and the `step_<N>` layout.

Everything here reads (or, for `mark_latest`, points at) a checkpoint that `checkpoint.save`
wrote; nothing runs a collective except through DCP's own reader. `read_meta` checks a folder
before anything is loaded from it (meta.json, sizes, the ranks' files, the index's SHA-256, an
index unpickled by a reader that builds DCP's records only); `verify_files` checks the
checksums; `full_model_state` reads one model's weights offline in one process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from .storage import CheckpointError, atomic_write_text, check_file, is_checkpoint, one_line

log = logging.getLogger("shardwise")
# What torch.distributed.checkpoint raises: its CheckpointException (a BaseException, holding each
# process's exception) and what a single process raises directly.
DCP_FAILURES = (CheckpointException, OSError, RuntimeError, ValueError, KeyError)

FORMAT = "shardwise-checkpoint"
VERSION = 1
META = "meta.json"
OURS = (META, FORMAT)  # the names that mark a folder as a checkpoint's (`storage.is_checkpoint`)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP keeps its index as a pickle; this unpickler builds only the classes such an index
    holds (DCP's metadata records, torch.Size, dtypes, paths) and refuses everything else."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"), ("torch", "Size"), ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    })

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in self._ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module == "torch.distributed.checkpoint.metadata":
                obj = super().find_class(module, name)
                if getattr(obj, "__module__", "") == module:
                    return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


class SafeReader(FileSystemReader):
    """DCP's file reader, with the index read by `_MetadataUnpickler` (tensor files are already
    read weights-only by DCP)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{path}: refused: {err}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: is not a checkpoint index")
        if metadata.storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def first_failure(err: BaseException) -> BaseException:
    """The first process's exception inside torch's CheckpointException (which derives from
    BaseException and prints every process's traceback)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return cast(BaseException, first[0] if isinstance(first, tuple) else first)
    return err


def read_meta(folder: Path) -> dict[str, Any]:
    """Check a checkpoint folder before anything is loaded from it; return its metadata.
    (Sizes, the ranks' files and the index; `verify_files` checks the checksums.)"""
    folder = Path(folder)
    if folder.is_file():
        raise CheckpointError(f"{folder}: is a file, not a checkpoint folder (give the folder save_state "
                              "wrote, e.g. checkpoints/step_100, or 'latest')")
    if not folder.is_dir():
        aside = folder.with_name(f".{folder.name}.previous")
        hint = (f" ({aside} holds the checkpoint a save was replacing when it stopped)"
                if aside.is_dir() else "")
        raise CheckpointError(f"{folder}: no such checkpoint folder{hint}")
    meta_path = folder / META
    if not meta_path.is_file():
        if any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
            raise CheckpointError(f"{folder}: holds model weights (a save_model export), not a training "
                                  "checkpoint: load them with engine.from_pretrained(cls, path) or the "
                                  "model's own from_pretrained; load_state reads what save_state wrote")
        raise CheckpointError(f"{folder}: no {META}: not a shardwise checkpoint, or a save that never "
                              "finished")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_path}: corrupted ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: not a shardwise checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: format version {meta.get('version')} is not {VERSION}")
    for name, size in meta["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        if path.stat().st_size != size:
            raise CheckpointError(f"{path}: truncated or changed ({path.stat().st_size} bytes, "
                                  f"expected {size})")
    ranks = sorted(int(m.group(1)) for p in (folder / "rng").glob("rank*.pt")
                   if (m := re.fullmatch(r"rank(\d+)\.pt", p.name)))
    if ranks != list(range(meta["world_size"])):
        raise CheckpointError(
            f"{meta_path}: says world size {meta['world_size']} but holds the states of "
            f"{len(ranks)} process(es); the metadata does not match the shards"
        )
    if sha256_file(folder / ".metadata") != meta["dcp_metadata_sha256"]:
        raise CheckpointError(f"{folder / '.metadata'}: does not match its recorded SHA-256 (corrupted or "
                              "altered)")
    SafeReader(str(folder)).read_metadata()  # the index must hold nothing but DCP's records
    return meta


def verify_files(folder: Path, meta: dict[str, Any], rank: int = 0, world: int = 1) -> str | None:
    """Check this process's share of the checkpoint's files (every `world`-th, from `rank`)
    against their recorded checksums; the first problem as one line, or None."""
    sums = meta.get("checksums")
    if sums is None:  # saved before checksums were recorded: sizes and the index are all we have
        if rank == 0:
            log.warning("%s: saved without checksums (shardwise before 0.2); only sizes are checked", folder)
        return None
    missing = sorted(set(meta["files"]) - set(sums))
    if missing:
        return f"{Path(folder) / META}: records no checksum for {missing[0]} (altered after the save)"
    for name in sorted(sums)[rank::world]:
        problem = check_file(Path(folder) / name, sums[name])
        if problem:
            return problem
    return None


def verify(path: Path) -> list[str]:
    """Check a checkpoint, or a folder written by `save_model`/`shardwise export`, against the
    checksums recorded when it was saved (in this process); the files checked.
    CheckpointError, one line naming the file, on the first mismatch."""
    from ..weights.export import verify_model_dir

    path = resolve(Path(path))
    if not (path / META).is_file():
        return verify_model_dir(path)
    meta = read_meta(path)
    problem = verify_files(path, meta)
    if problem:
        raise CheckpointError(problem)
    return sorted(meta.get("checksums") or meta["files"])


def check_models(meta: dict[str, Any], models: list[dict[str, Any]], folder: Path) -> None:
    """The checkpoint's models must be these models: same names, same shapes."""
    if len(meta["models"]) != len(models):
        raise CheckpointError(f"{folder}: holds {len(meta['models'])} model(s), {len(models)} prepared")
    for i, (saved, now) in enumerate(zip(meta["models"], models)):
        missing = sorted(set(now["params"]) - set(saved["params"]))
        unexpected = sorted(set(saved["params"]) - set(now["params"]))
        shaped = sorted(k for k in set(now["params"]) & set(saved["params"])
                        if now["params"][k] != saved["params"][k])
        if missing or unexpected or shaped:
            parts = []
            if missing:
                parts.append(f"missing {_few(missing)}")
            if unexpected:
                parts.append(f"unexpected {_few(unexpected)}")
            if shaped:
                pairs = [f"{k} {saved['params'][k]} vs {now['params'][k]}" for k in shaped]
                parts.append("mis-shaped " + _few(pairs))
            raise CheckpointError(f"{folder}: model {i} does not match the checkpoint: {'; '.join(parts)}")


# read by `restore_loop_state` with `.get` (checkpoints from before they were saved lack them)
_OPTIONAL_LOOP_KEYS = ("grad_accum_steps", "world_size")


def check_loop_state(saved: Any, now: dict[str, Any], path: Path) -> None:
    """A checkpoint's loop state must fit this run before anything is loaded: every key the
    loop restores, and one entry per scheduler, DataLoader and registered object prepared now."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: holds a {type(saved).__name__}, not a loop state")
    missing = [k for k in now if k not in saved and k not in _OPTIONAL_LOOP_KEYS]
    if missing:
        raise CheckpointError(f"{path}: the loop state lacks {_few(missing)} (not a shardwise loop state)")
    for key, objs in now.items():
        if isinstance(objs, list) and (not isinstance(saved[key], list) or len(saved[key]) != len(objs)):
            held = len(saved[key]) if isinstance(saved[key], list) else type(saved[key]).__name__
            raise CheckpointError(f"{path}: holds {held} {key}, {len(objs)} prepared now: prepare the "
                                  f"same {key} as the run that saved it before load_state")


def _few(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")


def load_safe(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as err:
        line = f"{path}: unreadable with weights-only loading ({type(err).__name__}: {err})"
        raise CheckpointError(one_line(line)) from None


def full_model_state(folder: Path, index: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One model's full weights, read offline from a checkpoint in this single process (after
    every file of the checkpoint is verified against its checksum)."""
    folder = Path(folder)
    meta = read_meta(folder)
    problem = verify_files(folder, meta)
    if problem:
        raise CheckpointError(problem)
    if not 0 <= index < len(meta["models"]):
        raise CheckpointError(f"{folder}: has no model {index} (it holds {len(meta['models'])})")
    model = meta["models"][index]
    template = {
        k: torch.empty(shape, dtype=getattr(torch, model["dtypes"][k]))
        for k, shape in model["params"].items()
    }
    try:
        dcp.load({f"model{index}": template}, storage_reader=SafeReader(str(folder)), no_dist=True)
    except CheckpointError:
        raise
    except DCP_FAILURES as err:
        first = first_failure(err)
        line = f"{folder}: could not read the sharded tensors: {type(first).__name__}: {first}"
        raise CheckpointError(one_line(line)) from None
    return template, meta


def step_dirs(root: Path) -> list[Path]:
    """Complete `step_<N>` checkpoints under `root`, oldest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


def newest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`: the highest complete step_<N> (a save that
    completed but died before moving `latest` counts), else what `latest` names; None when
    there is none."""
    root = Path(root)
    found = step_dirs(root) if root.is_dir() else []
    if found:
        return found[-1]
    pointer = root / "latest"
    if pointer.is_file() and (root / pointer.read_text().strip() / META).is_file():
        return root / pointer.read_text().strip()
    return None


def resolve(root_or_dir: Path) -> Path:
    """`latest` (or a folder holding a `latest` file) -> the newest complete checkpoint."""
    path = Path(root_or_dir)
    if path.name == "latest" and not path.is_dir():
        pointer = path
    elif (path / "latest").is_file():
        pointer = path / "latest"
    else:
        return path
    if not pointer.is_file():
        raise CheckpointError(f"{pointer}: no checkpoint has been completed yet")
    return pointer.parent / pointer.read_text().strip()


def mark_latest(root: Path, target: Path, keep_last: int | None) -> None:
    """Point `latest` at `target` and drop complete checkpoints beyond the newest `keep_last`
    (only folders that hold a shardwise checkpoint and nothing else)."""
    atomic_write_text(root / "latest", target.name + "\n")
    if keep_last is not None:
        for old in step_dirs(root)[:-keep_last]:
            if old == target:
                continue
            if is_checkpoint(old, *OURS):
                shutil.rmtree(old, ignore_errors=True)
            else:
                log.warning("%s: not pruned (keep_last): it holds files that are not part of its "
                            "checkpoint", old)
