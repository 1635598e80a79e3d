"""DeepSpeed's CPUAdam build (`host_kernel: deepspeed`): a build lock left by a killed build is
named in one line before torch would wait on it for ever; a lock in use is left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shardwise.strategies.host_step import STALE_BUILD_LOCK_S, _cpu_adam_op, stale_build_lock


def _lock(root: Path, age_s: float) -> Path:
    lock = root / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_stale_build_lock_is_named_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed", reason="the op builder is DeepSpeed's (an optional extra)")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path, STALE_BUILD_LOCK_S + 60)
    assert stale_build_lock("cpu_adam") == lock
    with pytest.raises(ValueError) as err:
        _cpu_adam_op()
    text = str(err.value)
    assert "\n" not in text and str(lock) in text and "delete that file" in text, text


def test_a_lock_in_use_or_none_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert stale_build_lock("cpu_adam") is None  # no lock
    _lock(tmp_path, 30)  # a build running now
    assert stale_build_lock("cpu_adam") is None
    # torch's default folder: <cache>/torch_extensions/<tag>/<name>
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = _lock(tmp_path / "cache" / "torch_extensions" / "py311_cpu", STALE_BUILD_LOCK_S + 1)
    assert stale_build_lock("cpu_adam") == old
    assert stale_build_lock("cpu_adam", now=old.stat().st_mtime + 5) is None
