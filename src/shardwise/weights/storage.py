"""Writing to disk without losing anything: checksums, atomic files, staging folders.

Every save of shardwise (a checkpoint, `save_model`, `shardwise export`) follows three rules:
  1. Nothing the user saved is removed or replaced unless shardwise wrote it: a checkpoint
     replaces only an earlier checkpoint (every file of which is named in its meta.json), and a
     model export replaces only its own file names, inside a folder whose other files stay.
  2. Nothing is half-written where the user looks: files are written into a staging folder
     `.<name>.incomplete` beside the target, flushed, and renamed into place (whole folders by
     an atomic exchange). A save killed midway leaves only that staging folder, which the next
     successful save to the same place removes.
  3. Every file gets an xxh3-64 checksum at save that is verified at load (~19 GB/s on one
     core here, so its cost is a fraction of the disk's).

It lives with the weights, whose exports write through it, and the checkpoint package builds
on it (`shardwise.checkpoint.storage` names the same functions): checkpoints need the weights'
own knowledge (tied names, a model's config.json, an export's checksums), so the weights must
not need the checkpoint package in turn.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import mmap
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import xxhash

from ..distributed.arrival import is_alone

ALGORITHM = "xxh3_64"
STAGING_MARK = ".shardwise-staging"  # made first in every staging folder: says the folder is ours


class CheckpointError(RuntimeError):
    """A checkpoint or model folder that cannot be written or loaded; one line naming the path,
    what is wrong and the fix."""


# -- checksums ---------------------------------------------------------------------------------
def _digest(h: xxhash.xxh3_64) -> str:
    return f"{ALGORITHM}:{h.hexdigest()}"


def checksum_file(path: Path) -> str:
    """The checksum of a whole file (read through mmap: no copy into Python memory)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(memoryview(mm))
    return _digest(h)


def check_file(path: Path, expected: str) -> str | None:
    """None when `path` has the checksum `expected`, else one line saying what is wrong."""
    if not path.is_file():
        return f"{path}: missing"
    if not expected.startswith(f"{ALGORITHM}:"):
        return f"{path}: recorded checksum {expected!r} is not {ALGORITHM}; saved by a newer shardwise?"
    actual = checksum_file(path)
    if actual != expected:
        return (f"{path}: checksum mismatch (corrupted or altered after it was saved: {actual}, "
                f"recorded {expected})")
    return None


# -- atomic files and folders -------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` through a temporary name: readers see the old text or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False where the
    system or file system cannot (the caller then falls back to two renames)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def staging_dir(target: Path) -> Path:
    """`.<name>.incomplete` beside `target`: on its file system, so what is staged renames into
    it. Where `target` is a mount point, `<target>/.shardwise.incomplete` instead."""
    target = Path(os.path.abspath(target))
    if target.is_dir() and os.stat(target).st_dev != os.stat(target.parent).st_dev:
        return target / ".shardwise.incomplete"
    return target.with_name(f".{target.name}.incomplete")


def is_checkpoint(folder: Path, meta_name: str, fmt: str) -> bool:
    """True when `folder` holds a shardwise checkpoint and nothing else (only files its meta names)."""
    try:
        meta = json.loads((folder / meta_name).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    if not isinstance(meta, dict) or meta.get("format") != fmt or not isinstance(meta.get("files"), dict):
        return False
    listed = set(meta["files"]) | {meta_name}
    return all(str(path.relative_to(folder)) in listed
               for path in folder.rglob("*") if path.is_file() or path.is_symlink())


def staging_is_ours(stage: Path, checkpoint: tuple[str, str] | None = None) -> bool:
    """A staging folder an interrupted save left: marked, empty, or (`checkpoint` = (meta file
    name, format)) a whole checkpoint that an exchange set aside."""
    return stage.is_dir() and not stage.is_symlink() and (
        (stage / STAGING_MARK).exists() or not any(stage.iterdir())
        or (checkpoint is not None and is_checkpoint(stage, *checkpoint))
    )


def clear_staging(stage: Path, checkpoint: tuple[str, str] | None = None) -> None:
    """Remove a staging folder left by an interrupted save if it is ours (`staging_is_ours`);
    anything else there is refused."""
    if not os.path.lexists(stage):
        return
    if staging_is_ours(stage, checkpoint):
        shutil.rmtree(stage)
        return
    raise CheckpointError(
        f"{stage}: is in the way of the save's staging folder and was not made by shardwise; "
        "move it, or save under another name"
    )


def new_staging(target: Path, checkpoint: tuple[str, str] | None = None) -> Path:
    """A fresh, marked staging folder for a save to `target` (see `clear_staging`)."""
    stage = staging_dir(target)
    clear_staging(stage, checkpoint)
    stage.mkdir(parents=True)
    (stage / STAGING_MARK).touch()
    return stage


def describe_entries(folder: Path, limit: int = 3) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def inside_cwd_check(target: Path) -> str | None:
    """A save must never replace the current directory or a folder that holds it."""
    here, there = Path.cwd().resolve(), Path(os.path.abspath(target)).resolve()
    if here == there or there in here.parents:
        holds = " or holds it" if here != there else ""
        return f"{target}: is the current directory{holds}; save into a subfolder"
    return None


def agree(error: str | None, group: Any = None) -> None:
    """Every process raises the same CheckpointError when any process had one (a collective
    where a process group is up: no process is left waiting for one that gave up). `group`: the
    process group to agree on (None: the default one; a background write passes its own)."""
    import torch.distributed as dist

    errors: list[str | None] = [error]
    if not is_alone() and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first is not None:
        raise CheckpointError(first)


class WriteFailed(OSError):
    """A write the OS refused (its errno kept), with the bytes the file needed."""

    needed: int | None = None


def write_torch(obj: Any, path: Path) -> int:
    """`torch.save(obj, path)`, the bytes made in memory first and written by this process: a
    full disk then fails as the OS says (ENOSPC, EFBIG, with the bytes needed), where torch's
    own zip writer says `[enforce fail at inline_container.cc] unexpected pos`. (For the small
    files it is used for: loop state, generator states.)"""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as err:
        failed = WriteFailed(err.errno, err.strerror, str(path))
        failed.needed = len(data)
        raise failed from None
    return len(data)


def _zip_writer_reason(path: Path, needed: int | None) -> str | None:
    """What torch's zip writer (`torch.save` to a path) failed on: its message carries no errno,
    so tell a full disk and the file-size limit apart from here; None when neither explains it."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if shutil.disk_usage(probe).free < max(needed or 0, 1 << 20):
        return os.strerror(errno.ENOSPC)
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return os.strerror(errno.EFBIG)
    return None


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def os_error_line(path: Path, action: str, err: BaseException, needed: int | None = None) -> str:
    """`<path>: could not <action>: <the OS's reason> ...`, plus the bytes needed (`needed`, or
    what a `WriteFailed` says) and the fix for the common reasons."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    where = getattr(err, "filename", None)
    needed = getattr(err, "needed", None) or needed
    code = getattr(err, "errno", None)
    if not isinstance(err, OSError) and ("inline_container" in reason or "PytorchStreamWriter" in reason):
        reason = _zip_writer_reason(path, needed) or reason
        code = {os.strerror(errno.ENOSPC): errno.ENOSPC, os.strerror(errno.EFBIG): errno.EFBIG}.get(reason)
    fix = {
        errno.ENOSPC: f"free space on the disk of {path}, or save elsewhere",
        errno.EDQUOT: f"free space in your quota for {path}, or save elsewhere",
        errno.EFBIG: "a file grew past the file-size limit (ulimit -f); raise it, or save elsewhere",
        errno.EACCES: f"make {path.parent} writable, or save elsewhere",
        errno.EROFS: "the file system is read-only; save elsewhere",
    }.get(code or -1, "")
    detail = f"{reason} ({where})" if where else reason
    if needed and code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        detail += f"; it needs {_size(needed)}"
    return one_line(f"{path}: could not {action}: {detail}" + (f"; {fix}" if fix else ""))


def _size(n: int) -> str:
    return f"{n} bytes" if n < 10_000 else f"{n / 1e6:.1f} MB ({n} bytes)"
