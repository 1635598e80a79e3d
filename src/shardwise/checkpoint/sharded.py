"""Training checkpoints: sharded, resumable at any world size or strategy, atomic, and safe.

Layout of one checkpoint folder:
  meta.json         written last: format, world size, sharding group size, strategy, precision,
                    versions, every model's parameter names/shapes/dtypes, file sizes, the DCP
                    metadata hash
  .metadata, *.distcp   torch.distributed.checkpoint (DCP): models and optimizers, each process
                    writing its own shards in parallel. Tensors are keyed by parameter name and
                    stored whole or as DTensor shards, so DCP reshards on load.
  engine.pt         counters, loss scaler, schedulers, DataLoader positions, registered objects
  rng/rank<r>.pt    each process's python, numpy, torch (and CUDA) generator states
  model<i>.config.json   a `transformers` model's config (for `shardwise export`)

A save goes into `.<name>.incomplete` and replaces `<name>` in one atomic exchange when complete
(see `storage`); `latest` (a file naming the newest complete checkpoint) is replaced atomically
after that. A save replaces only an empty folder or an earlier checkpoint; any other folder, a
file, or the current directory is refused before anything is written. meta.json records every
file's size and xxh3-64 checksum (each process hashes the files it wrote, from the page cache);
a load verifies them all first, each process a share of the files. Loading reads only JSON and
weights-only tensors: DCP's pickled `.metadata` is opened only after its SHA-256 matches the one
recorded in meta.json. The engine's `CheckpointManager` (`manager`) calls these two: it holds the
run lock (`runlock`: one run per checkpoint folder), names the folders, moves `latest` once a
folder is in place and owns the background writer of `checkpoint_async` (`background`: the
state copied to host memory on the calling thread, written as above by a writer thread).
Saving and loading are here; reading a folder's
format, its checks and the `step_<N>` layout are `checkpoint_files` (its names are re-exported).

Hybrid sharding (`shard_group_size` G < W): every shard exists once per replica group, but is
written once. A replicated shard is the same DCP write item (parameter name, offset) on each of
its R = W/G holders, as is a whole tensor every process holds (ddp, zero1's gathered optimizer
state); DCP's save planner keeps each item in one plan only, the one with the fewest bytes so
far, so the W processes write the checkpoint's bytes once between them (about 1/W each, fewer
per process as groups are added). The planning itself exchanges plan metadata, not tensors. On
load each process reads only its own shard (1/G of the model), whatever R is, and the layout is
DCP's by parameter name, so a hybrid checkpoint loads at any world size, strategy or group size
and any checkpoint loads as hybrid (tests/test_hybrid_resume.py).
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from ..distributed.arrival import is_alone
from ..distributed.internals import one_block_placements
from ..version import __version__
from ..weights.export import find_aliases, hf_config_json
from .background import BackgroundWriter, stage as stage_copy
from .files import (
    DCP_FAILURES,
    FORMAT,
    META,
    OURS,
    VERSION,
    SafeReader,
    check_loop_state,
    check_models,
    first_failure,
    full_model_state,
    load_safe,
    mark_latest,
    newest,
    read_meta,
    resolve,
    sha256_file,
    step_dirs,
    verify,
    verify_files,
)
from .parts import Parts
from .storage import (
    STAGING_MARK,
    CheckpointError,
    agree,
    atomic_write_text,
    checksum_file,
    clear_staging,
    describe_entries,
    exchange,
    fsync_path,
    inside_cwd_check,
    is_checkpoint,
    new_staging,
    one_line,
    os_error_line,
    staging_dir,
    staging_is_ours,
    write_torch,
)

log = logging.getLogger("shardwise")

__all__ = [
    "FORMAT", "META", "VERSION", "CheckpointError", "Parts", "SaveReport", "check_models", "full_model_state",
    "kept_rng", "load", "mark_latest", "newest", "read_meta", "resolve", "save", "step_dirs", "verify",
    "verify_files",
]


def _versions() -> dict[str, str]:
    return {"shardwise": __version__, "torch": torch.__version__}


def _model_meta(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "params": {k: list(v.shape) for k, v in state.items() if torch.is_tensor(v)},
        "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in state.items() if torch.is_tensor(v)},
        "aliases": find_aliases(module),
    }


def _rng_state() -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    out: dict[str, Any] = {
        "python": [list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # this process's GPU's generator only (the one the engine set: its local rank's). Every
        # visible GPU's would not load where fewer are visible, and the others are other
        # processes' devices, which nothing here draws from.
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"][0]), state["python"][1]))
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # saved by an earlier release: every visible GPU's
            here = torch.cuda.current_device()
            cuda = cuda[here] if here < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


AFTER_HOOKS = ".after_hooks.pt"  # rng/rank<r>.after_hooks.pt: the generator states once save hooks ran


def rng_state() -> dict[str, Any]:
    """This process's generator states (python, numpy, torch, CUDA), as a checkpoint holds them."""
    return _rng_state()


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Every generator (python, numpy, torch, CUDA) after the block as it was before it: for work
    that must not change what a run draws (a plan, a trial read of a dataset's samples)."""
    state = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(state)


def _same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if torch.is_tensor(x) and torch.is_tensor(y):
            return torch.equal(x, y)
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y))
        return bool(x == y)

    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def save_rng_after_hooks(folder: Path, rank: int, before: dict[str, Any]) -> None:
    """This process's generator states now, beside the checkpoint's own (`rng/rank<r>` +
    AFTER_HOOKS), written atomically (whole or absent), when the save-state hooks drew from them
    since `before` (the checkpoint's): Accelerate saves its RNG after its hooks ran, so their
    draws (diffusers' EMA building a model to save it) are in the state a resumed run continues
    from. A load prefers it to the state taken at the save."""
    if _same_rng(before, _rng_state()):
        return
    path = Path(folder) / "rng" / f"rank{rank}{AFTER_HOOKS}"
    tmp = path.with_name(f".{path.name}.tmp")
    write_torch(_rng_state(), tmp)
    os.replace(tmp, path)


def _dcp_state(parts: Parts) -> dict[str, Any]:
    """The tensors DCP writes or loads: every model's and optimizer's state, in this run's layout."""
    state: dict[str, Any] = {}
    for i, model in enumerate(parts.models):
        state[f"model{i}"] = parts.strategy.model_state(model)
    for j, runner in enumerate(parts.runners):
        state[f"optim{j}"] = runner.checkpoint_state(parts.models[parts.optimizer_models[j]])
    return state


# -- layouts DCP can describe ------------------------------------------------------------------
def _describable(obj: Any) -> Any:
    """`obj` (a state dict, nested) with every DTensor DCP cannot describe (a rank holding several
    runs of a dimension, not one block: `one_block_placements`) redistributed to one it can (a
    copy: one tensor's extra all-gather at a time)."""
    if isinstance(obj, DTensor):
        placements = one_block_placements(obj.placements)
        return obj if placements is None else obj.redistribute(obj.device_mesh, placements)
    if isinstance(obj, dict):
        return {k: _describable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_describable(v) for v in obj]
    return obj


def _in_layout(loaded: Any, template: Any) -> Any:
    """`loaded` (from `_describable(template)`) back in `template`'s placements."""
    if isinstance(template, DTensor) and isinstance(loaded, DTensor) and loaded is not template:
        return loaded.redistribute(template.device_mesh, template.placements)
    if isinstance(template, dict) and isinstance(loaded, dict):
        return {k: _in_layout(v, template.get(k)) for k, v in loaded.items()}
    if isinstance(template, list) and isinstance(loaded, list):
        return [_in_layout(v, t) for v, t in zip(loaded, template)]
    return loaded


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering which files this process wrote (it hashes them after)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # FileSystemWriter writes synchronously
        self.written = sorted({r.storage_data.relative_path for r in future.value()})
        return future


@dataclass(frozen=True)
class SaveReport:
    """What one save wrote and what it cost."""

    path: Path
    bytes: int
    seconds: float  # writing it (an asynchronous save: in the background; 0.0 while pending)
    checksum_seconds: float  # this process's share of hashing (the files it wrote)
    stall: float = 0.0  # seconds the caller was blocked: a synchronous save's whole time; an
    # asynchronous one's wait for the save before it plus the staging copy
    pending: bool = False  # an asynchronous save still being written (bytes and seconds unknown yet)


@dataclass
class _Snapshot:
    """What a save writes, taken at the call (an asynchronous save: copied, as training moves on)."""

    state: dict[str, Any]  # the DCP state dict
    rng: dict[str, Any]  # this process's generator states
    loop_state: dict[str, Any]
    models: list[dict[str, Any]]  # meta.json's entry of each model
    configs: list[str | None]  # each model's `transformers` config.json text
    nbytes: int = 0  # the staged copy's bytes (0: not copied)


def _check_target(target: Path, stage: Path) -> str | None:
    """Why a checkpoint must not be written to `target` (None: it may). Nothing is written here."""
    if problem := inside_cwd_check(target):
        return problem
    if target.is_symlink():
        return f"{target}: is a symbolic link; save to the folder it points to, or choose another name"
    if target.exists() and not target.is_dir():
        return (f"{target}: is a file, not a checkpoint; nothing was written: choose another path, or move "
                "the file")
    if target.is_dir() and any(target.iterdir()) and not is_checkpoint(target, *OURS):
        return (f"{target}: holds files that are not a shardwise checkpoint ({describe_entries(target)}); "
                "a checkpoint replaces only an empty folder or an earlier checkpoint: choose another path")
    if stage.parent == target:
        return (f"{target}: is a mount point, which cannot be replaced as a whole; save into a folder "
                "inside it")
    if os.path.lexists(stage) and not staging_is_ours(stage, OURS):
        return f"{stage}: is in the way of the save's staging folder and was not made by shardwise; move it"
    return None


Then = Callable[[SaveReport, Any], None]  # (report, the process group of the thread that wrote it)


def save(parts: Parts, target: Path, *, writer: BackgroundWriter | None = None,
         group: Callable[[], Any] | None = None, then: Then | None = None) -> SaveReport:
    """Write a checkpoint of `parts` to `target` (a collective: every process calls it).

    Refused with one line, before anything is written, when `target` is a file, the current
    directory, or a folder that is neither empty nor an earlier checkpoint. A failed save leaves
    the previous checkpoint at `target` untouched and removes what it wrote. A save pending
    in `writer` completes first. `then(report, group)` runs on every process once the checkpoint
    is in place (collectives in it go on `group`). The caller (`CheckpointManager`) holds the run
    lock.

    `writer` (`checkpoint_async`): stage the state to host memory, start its write in that
    background writer, whose collectives go on `group()` (a gloo group of every process, made
    by a collective at the first such save), and return at once; the report says `pending` and
    the stall.
    """
    target = Path(target)
    stage = staging_dir(target)
    start = time.perf_counter()
    if writer is not None:
        writer.wait()  # one save in flight: a pending one completes first (or raises)
    agree(_check_target(target, stage) if parts.rank == 0 else None)
    background = writer is not None and group is not None
    if background and (is_alone() or not dist.is_initialized()):
        # a lone process's save (Accelerate's save_state called on one ddp process) runs no
        # collective, and no process group is there for a writer thread's: it is written now
        log.info("%s: saved synchronously: a save by one process alone has no group for a background "
                 "writer", target)
        background = False
    bg_group = group() if group is not None and background else None  # a collective: every process is here
    try:
        _begin(parts, target)
        snap = _snapshot(parts, writer if background else None)
        if not background:
            report = _write(parts, target, stage, snap, start, None, None)
    except BaseException:
        if parts.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    if not background:
        if then is not None:
            then(report, None)
        return report
    stall = time.perf_counter() - start

    def job() -> None:
        try:
            done = _write(parts, target, stage, snap, time.perf_counter(), bg_group, stall)
        except BaseException:
            if parts.rank == 0:
                shutil.rmtree(stage, ignore_errors=True)
            raise
        if then is not None:
            then(done, bg_group)

    assert writer is not None
    writer.start(target, snap.nbytes, job)
    return SaveReport(target, 0, 0.0, 0.0, stall=stall, pending=True)


def _begin(parts: Parts, target: Path) -> None:
    """Process 0 makes the staging folder (any earlier one of ours removed); every process agrees."""
    error = None
    if parts.rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            stage = new_staging(target, OURS)
            (stage / "rng").mkdir()
        except (OSError, CheckpointError) as err:
            error = (str(err) if isinstance(err, CheckpointError)
                     else os_error_line(target, "start the checkpoint", err))
    agree(error)


def _snapshot(parts: Parts, writer: BackgroundWriter | None) -> _Snapshot:
    """The state to write, now. With `writer`: copied into fresh host memory (`background.stage`,
    its pinned buffers on CUDA), the loop state too, so training may go on while it is written."""
    state = _describable(_dcp_state(parts))  # (zero1: gathers its optimizer state, a collective)
    # meta.json's model entries and config.json texts: process 0 alone writes them (`_finish`)
    mine = parts.unwrapped if parts.rank == 0 else []
    configs = [hf_config_json(module) for module in mine]
    models = [_model_meta(m, state[f"model{i}"]) for i, m in enumerate(mine)]
    if writer is None:
        return _Snapshot(state, _rng_state(), parts.loop_state, models, configs)
    staged, nbytes = stage_copy(state, writer.pool)
    return _Snapshot(staged, _rng_state(), copy_module.deepcopy(parts.loop_state), models, configs, nbytes)


def _write(parts: Parts, target: Path, stage: Path, snap: _Snapshot, start: float, group: Any,
           stall: float | None) -> SaveReport:
    """Write `snap` into the staging folder and move it into place. `group`: the process group of
    every collective here (None: the default one; a background write's own, see `dist`);
    `stall`: an asynchronous save's (None: synchronous, the whole time is the stall)."""
    writer = _RecordingWriter(stage)
    try:
        # each process writes its own shards (a process saving alone: no collective at all)
        dcp.save(snap.state, storage_writer=writer, process_group=group, no_dist=is_alone())
    except DCP_FAILURES as err:  # DCP agrees on failure across processes itself
        needed = _tensor_bytes(snap.state)  # the same on every process: the message is too
        line = os_error_line(target, "write the checkpoint's tensors", first_failure(err), needed)
        raise CheckpointError(line) from None
    sums: dict[str, str] = {}
    hashing = 0.0
    error = None
    try:
        write_torch(snap.rng, stage / "rng" / f"rank{parts.rank}.pt")
        t0 = time.perf_counter()
        for name in [*writer.written, f"rng/rank{parts.rank}.pt"]:
            sums[name] = checksum_file(stage / name)  # just written: read back from the page cache
        hashing = time.perf_counter() - t0
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as a RuntimeError
        error = os_error_line(target, "write the checkpoint", err)
    gathered: list[Any] = [(error, sums)]
    if parts.world > 1:
        gathered = [None] * parts.world
        dist.all_gather_object(gathered, (error, sums), group=group)
    agree(next((e for e, _ in gathered if e), None), group)
    size, error = 0, None
    if parts.rank == 0:
        try:
            size = _finish(parts, target, stage, snap, {k: v for _, s in gathered for k, v in s.items()})
        except (OSError, RuntimeError) as err:  # (CheckpointError is a RuntimeError)
            error = (str(err) if isinstance(err, CheckpointError)
                     else os_error_line(target, "finish the checkpoint", err))
    agree(error, group)
    seconds = time.perf_counter() - start
    report = SaveReport(target, size, seconds, hashing, stall=seconds if stall is None else stall)
    if parts.rank == 0:
        how = "" if stall is None else " in the background"
        log.info("saved %s: %.3f GB in %.2f s%s (checksums %.3f s); training stalled %.2f s", target,
                 size / 1e9, report.seconds, how, hashing, report.stall)
    return report


def _finish(parts: Parts, target: Path, stage: Path, snap: _Snapshot, sums: dict[str, str]) -> int:
    """Process 0: the loop state, meta.json (written last), then the exchange into place."""
    write_torch(snap.loop_state, stage / "engine.pt")  # (the loop state; file name of format 1)
    for i, config in enumerate(snap.configs):
        if config is not None:
            (stage / f"model{i}.config.json").write_text(config)
    files = {str(p.relative_to(stage)): p.stat().st_size for p in sorted(stage.rglob("*"))
             if p.is_file() and p.name != STAGING_MARK}
    for name in files:
        if name not in sums:
            sums[name] = checksum_file(stage / name)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": parts.world,
        "shard_group_size": parts.strategy.shard_group_size,  # (informative: loading reshards)
        "engine": parts.info["backend"],  # (the backend; key name of format 1)
        **{k: v for k, v in parts.info.items() if k != "backend"},
        "versions": _versions(),
        "models": snap.models,
        "optimizers": [{"model": m, "class": type(r.optimizer).__name__}
                       for m, r in zip(parts.optimizer_models, parts.runners)],
        "files": files,
        "checksums": {name: sums[name] for name in files},
        "dcp_metadata_sha256": sha256_file(stage / ".metadata"),
    }
    atomic_write_text(stage / META, json.dumps(meta, indent=1))
    (stage / STAGING_MARK).unlink()  # from here on the folder is a complete checkpoint
    for name in ("rng", "."):
        fsync_path(stage / name)
    _into_place(stage, target)
    return sum(files.values())


def _into_place(stage: Path, target: Path) -> None:
    """`stage` becomes `target` atomically; the folder it replaces (an empty one or an earlier
    checkpoint) is removed after."""
    if not target.exists():
        stage.rename(target)
    elif exchange(stage, target):
        shutil.rmtree(stage)  # now the previous checkpoint
    else:  # no atomic exchange on this file system: set the previous one aside for an instant
        aside = target.with_name(f".{target.name}.previous")
        clear_staging(aside, OURS)
        target.rename(aside)
        stage.rename(target)
        shutil.rmtree(aside)
    fsync_path(target.parent)


def _tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in `obj`, whole (a DTensor's global size; a replicated tensor,
    which DCP writes once, counted once): about what the checkpoint's shards need on disk."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (dict, list, tuple)):
        return sum(_tensor_bytes(v) for v in (obj.values() if isinstance(obj, dict) else obj))
    return 0


def load(parts: Parts, folder: Path) -> dict[str, Any]:
    """Load a checkpoint into `parts` (a collective); return the loop state to restore.
    Every file is checked against its checksum first (each process a share), so nothing is
    loaded from a checkpoint that is not the one that was written. The caller
    (`CheckpointManager`) has waited for its pending save and holds the run lock."""
    folder = Path(folder)
    meta = read_meta(folder)
    agree(verify_files(folder, meta, parts.rank, parts.world))
    if len(meta["optimizers"]) != len(parts.runners):
        raise CheckpointError(f"{folder}: holds {len(meta['optimizers'])} optimizer(s), "
                              f"{len(parts.runners)} prepared")
    templates = _dcp_state(parts)  # in this run's layout; DCP reshards into them
    metas = [_model_meta(m, templates[f"model{i}"]) for i, m in enumerate(parts.unwrapped)]
    check_models(meta, metas, folder)
    # the small files first (every process, then agreed): one that cannot be read refuses the
    # checkpoint before a single weight has moved
    loop_state, rng = _read_small_files(folder, parts.rank, parts.loop_state)
    state = _describable(templates)
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)))
        state = _in_layout(state, templates)
    except CheckpointError:
        raise
    except DCP_FAILURES as err:
        raise CheckpointError(_load_failure(folder, meta, parts, first_failure(err))) from None
    for i, model in enumerate(parts.models):
        parts.strategy.load_model_state(model, state[f"model{i}"])
    for j, runner in enumerate(parts.runners):
        runner.load_checkpoint_state(parts.models[parts.optimizer_models[j]], state[f"optim{j}"])
    if rng is not None:
        _set_rng_state(rng)
    return loop_state


def _read_small_files(folder: Path, rank: int, now: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The loop state (engine.pt) and this rank's RNG state, read with weights-only loading; an
    unreadable one, or a loop state that is not of this run's shape (`now`), raises the same
    CheckpointError on every process."""
    rank_file = folder / "rng" / f"rank{rank}.pt"
    after_hooks = rank_file.with_name(f"rank{rank}{AFTER_HOOKS}")
    error, loop_state, rng = None, {}, None
    try:
        loop_state = cast(dict[str, Any], load_safe(folder / "engine.pt"))
        check_loop_state(loop_state, now, folder / "engine.pt")
        if after_hooks.is_file():  # the state once the save hooks ran (`save_rng_after_hooks`)
            rng = load_safe(after_hooks)
        elif rank_file.is_file():  # at a larger world size, new ranks keep their own seeds
            rng = load_safe(rank_file)
    except CheckpointError as err:
        error = str(err)
    agree(error)
    return loop_state, rng


def _load_failure(folder: Path, meta: dict[str, Any], parts: Parts, err: BaseException) -> str:
    """One line for what DCP could not load: which key, why, and the fix."""
    text = str(err)
    m = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", text)
    o = re.fullmatch(r"optim(\d+)\.(.+)", m.group(1)) if m else None
    if o and int(o.group(1)) < len(parts.runners):
        j, rest = int(o.group(1)), o.group(2)
        s = re.fullmatch(r"state\.(.+)\.([A-Za-z_0-9]+)", rest)
        what = f"'{s.group(2)}' state for {s.group(1)}" if s else f"'{rest}'"
        now = type(parts.runners[j].optimizer).__name__
        saved = meta["optimizers"][j].get("class") if j < len(meta["optimizers"]) else None
        was = f" (it was saved with {saved})" if saved else ""
        fix = (f"prepare {saved} as when it was saved" if saved and saved != now
               else "prepare the optimizer it was saved with")
        return one_line(f"{folder}: optimizer {j} ({now}) needs {what}, which the checkpoint does not "
                        f"hold{was}: {fix}")
    if m:
        return one_line(f"{folder}: holds no '{m.group(1)}', which this run needs: prepare the same models, "
                        "optimizers and settings as when it was saved")
    return one_line(f"{folder}: could not read the sharded tensors: {type(err).__name__}: {text}")


