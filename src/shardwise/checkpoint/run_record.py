"""The run record of `shardwise launch`: one JSON line per checkpoint its workers saved.

The launcher makes the file and names it in RUN_RECORD_ENV; every machine's local process 0
appends a line per save into the run's checkpoint folder (and one when the run stops). It tells
the launcher what a stopped run saved, and a restarted attempt that an earlier attempt saved a
checkpoint it must find.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

RUN_RECORD_ENV = "SHARDWISE_RUN_RECORD"  # set by `shardwise launch`: a file for the saves of its workers


def attempt() -> int:
    """Which attempt of a `--max-restarts` launch this is (0: the first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def read_run_record(path: str) -> list[dict[str, Any]]:
    """The record's lines; a line cut short is skipped, a missing file is empty."""
    rows = []
    with contextlib.suppress(OSError), open(path or os.devnull) as fh:
        for line in fh:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return [r for r in rows if isinstance(r, dict)]


def this_run() -> list[dict[str, Any]]:
    """The lines of this launch's record (empty outside `shardwise launch`)."""
    return read_run_record(os.environ.get(RUN_RECORD_ENV, ""))


def append(step: int, seconds: float, *, path: str = "", stop: str = "") -> None:
    """One line (call on one process per machine): a save of `step` at `path`, or the stop."""
    record = os.environ.get(RUN_RECORD_ENV)
    if not record:
        return
    line = {"attempt": attempt(), "step": step, "seconds": round(seconds, 3), "path": path, "stop": stop}
    with contextlib.suppress(OSError), open(record, "a") as fh:
        fh.write(json.dumps(line) + "\n")
