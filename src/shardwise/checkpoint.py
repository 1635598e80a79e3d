"""Training checkpoints: sharded, resumable at any world size or strategy, atomic, and safe.

Layout of one checkpoint folder:
  meta.json         written last: format, world size, strategy, precision, versions, every
                    model's parameter names/shapes/dtypes, file sizes, the DCP metadata hash
  .metadata, *.distcp   torch.distributed.checkpoint (DCP): models and optimizers, each process
                    writing its own shards in parallel. Tensors are keyed by parameter name and
                    stored whole or as DTensor shards, so DCP reshards on load.
  engine.pt         counters, loss scaler, schedulers, DataLoader positions, registered objects
  rng/rank<r>.pt    each process's python, numpy, torch (and CUDA) generator states
  model<i>.config.json   a `transformers` model's config (for `shardwise export`)

A save goes into `.<name>.incomplete` and is renamed into place when complete; `latest` (a
file naming the newest complete checkpoint) is replaced atomically after that. Loading reads
only JSON and weights-only tensors: DCP's pickled `.metadata` is opened only after its SHA-256
matches the one recorded in meta.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .consolidate import find_aliases, hf_config_json, swap_into_place

FORMAT = "shardwise-checkpoint"
VERSION = 1
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message says which file and why."""


@dataclass
class Parts:
    """What an engine checkpoints (the engine fills this; nothing here reaches into it)."""

    models: list[nn.Module]
    unwrapped: list[nn.Module]
    runners: list[Any]  # OptimizerRunner per prepared optimizer
    optimizer_models: list[int]  # index of the model each optimizer updates
    engine_state: dict[str, Any]  # counters, scaler, schedulers, loaders, registered objects
    strategy: Any  # model_state / load_model_state: the weights in the strategy's layout
    info: dict[str, Any]  # strategy, offload, precision, engine name
    rank: int
    world: int


class _MetadataUnpickler(pickle.Unpickler):
    """DCP keeps its index as a pickle; this unpickler builds only the classes such an index
    holds (DCP's metadata records, torch.Size, dtypes, paths) and refuses everything else."""

    _ALLOWED = {
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"), ("torch", "Size"), ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    }

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


class _SafeReader(FileSystemReader):
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
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _versions() -> dict[str, str]:
    from . import __version__

    return {"shardwise": __version__, "torch": torch.__version__}


def _model_meta(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "params": {k: list(v.shape) for k, v in state.items() if torch.is_tensor(v)},
        "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in state.items() if torch.is_tensor(v)},
        "aliases": find_aliases(module),
    }


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"][0]), state["python"][1]))
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _dcp_state(parts: Parts) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, model in enumerate(parts.models):
        state[f"model{i}"] = parts.strategy.model_state(model)
    for j, runner in enumerate(parts.runners):
        state[f"optim{j}"] = runner.checkpoint_state(parts.models[parts.optimizer_models[j]])
    return state


def save(parts: Parts, target: Path) -> Path:
    """Write a checkpoint of `parts` to `target` (a collective: every process calls it)."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.incomplete")
    if parts.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "rng").mkdir()
    dist.barrier()
    state = _dcp_state(parts)
    dcp.save(state, checkpoint_id=str(tmp))  # each process writes its own shards
    torch.save(_rng_state(), tmp / "rng" / f"rank{parts.rank}.pt")
    dist.barrier()
    if parts.rank == 0:
        torch.save(parts.engine_state, tmp / "engine.pt")

        models = []
        for i, module in enumerate(parts.unwrapped):
            models.append(_model_meta(module, state[f"model{i}"]))
            config = hf_config_json(module)
            if config is not None:
                (tmp / f"model{i}.config.json").write_text(config)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": parts.world,
            **parts.info,
            "versions": _versions(),
            "models": models,
            "optimizers": [{"model": m} for m in parts.optimizer_models],
            "files": files,
            "dcp_metadata_sha256": _sha256(tmp / ".metadata"),
        }
        _atomic_write(tmp / META, json.dumps(meta, indent=1))
        _fsync_dir(tmp)
        swap_into_place(tmp, target)
        _fsync_dir(target.parent)
    dist.barrier()
    return target


def read_meta(folder: Path) -> dict[str, Any]:
    """Check a checkpoint folder before anything is loaded from it; return its metadata."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    meta_path = folder / META
    if not meta_path.is_file():
        raise CheckpointError(f"{folder}: no {META}: not a shardwise checkpoint, or a save that never finished")
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
            raise CheckpointError(f"{path}: truncated or changed ({path.stat().st_size} bytes, expected {size})")
    ranks = sorted(int(m.group(1)) for p in (folder / "rng").glob("rank*.pt") if (m := re.fullmatch(r"rank(\d+)\.pt", p.name)))
    if ranks != list(range(meta["world_size"])):
        raise CheckpointError(
            f"{meta_path}: says world size {meta['world_size']} but holds the states of "
            f"{len(ranks)} process(es); the metadata does not match the shards"
        )
    if _sha256(folder / ".metadata") != meta["dcp_metadata_sha256"]:
        raise CheckpointError(f"{folder / '.metadata'}: does not match its recorded SHA-256 (corrupted or altered)")
    _SafeReader(str(folder)).read_metadata()  # the index must hold nothing but DCP's records
    return meta


def check_models(meta: dict[str, Any], models: list[dict[str, Any]], folder: Path) -> None:
    """The checkpoint's models must be these models: same names, same shapes."""
    if len(meta["models"]) != len(models):
        raise CheckpointError(f"{folder}: holds {len(meta['models'])} model(s), {len(models)} prepared")
    for i, (saved, now) in enumerate(zip(meta["models"], models)):
        missing = sorted(set(now["params"]) - set(saved["params"]))
        unexpected = sorted(set(saved["params"]) - set(now["params"]))
        shaped = sorted(k for k in set(now["params"]) & set(saved["params"]) if now["params"][k] != saved["params"][k])
        if missing or unexpected or shaped:
            parts = []
            if missing:
                parts.append(f"missing {_few(missing)}")
            if unexpected:
                parts.append(f"unexpected {_few(unexpected)}")
            if shaped:
                parts.append("mis-shaped " + _few([f"{k} {saved['params'][k]} vs {now['params'][k]}" for k in shaped]))
            raise CheckpointError(f"{folder}: model {i} does not match the checkpoint: {'; '.join(parts)}")


def _few(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")


def load(parts: Parts, folder: Path) -> dict[str, Any]:
    """Load a checkpoint into `parts` (a collective); return the engine state to restore."""
    folder = Path(folder)
    meta = read_meta(folder)
    if len(meta["optimizers"]) != len(parts.runners):
        raise CheckpointError(f"{folder}: holds {len(meta['optimizers'])} optimizer(s), {len(parts.runners)} prepared")
    state = _dcp_state(parts)  # templates in this run's layout; DCP reshards into them
    check_models(meta, [_model_meta(m, state[f"model{i}"]) for i, m in enumerate(parts.unwrapped)], folder)
    try:
        dcp.load(state, storage_reader=_SafeReader(str(folder)))
    except CheckpointError:
        raise
    except Exception as err:  # DCP raises many kinds; the user needs the file and the cause
        raise CheckpointError(_one_line(f"{folder}: could not read the sharded tensors: {type(err).__name__}: {err}")) from None
    for i, model in enumerate(parts.models):
        parts.strategy.load_model_state(model, state[f"model{i}"])
    for j, runner in enumerate(parts.runners):
        runner.load_checkpoint_state(parts.models[parts.optimizer_models[j]], state[f"optim{j}"])
    rank_file = folder / "rng" / f"rank{parts.rank}.pt"
    if rank_file.is_file():  # at a larger world size, new ranks keep their own seeds
        _set_rng_state(_load_safe(rank_file))
    return _load_safe(folder / "engine.pt")


def _load_safe(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(_one_line(f"{path}: unreadable with weights-only loading ({type(err).__name__}: {err})")) from None


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def full_model_state(folder: Path, index: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One model's full weights, read offline from a checkpoint in this single process."""
    folder = Path(folder)
    meta = read_meta(folder)
    if not 0 <= index < len(meta["models"]):
        raise CheckpointError(f"{folder}: has no model {index} (it holds {len(meta['models'])})")
    model = meta["models"][index]
    template = {
        k: torch.empty(shape, dtype=getattr(torch, model["dtypes"][k])) for k, shape in model["params"].items()
    }
    try:
        dcp.load({f"model{index}": template}, storage_reader=_SafeReader(str(folder)), no_dist=True)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(_one_line(f"{folder}: could not read the sharded tensors: {type(err).__name__}: {err}")) from None
    return template, meta


def step_dirs(root: Path) -> list[Path]:
    """Complete `step_<N>` checkpoints under `root`, oldest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


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
    """Point `latest` at `target` and drop complete checkpoints beyond the newest `keep_last`."""
    _atomic_write(root / "latest", target.name + "\n")
    if keep_last is not None:
        for old in step_dirs(root)[:-keep_last]:
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
