"""Trackers with Accelerate's API: where `log()` and the engine's own metrics go.

"jsonl" (no dependency): one JSON object per line in `<project_dir>/<run>/metrics.jsonl`.
"tensorboard" (`pip install 'shardwise[tensorboard]'`): torch's SummaryWriter event files.
"wandb" (`pip install wandb`): a W&B run; offline unless WANDB_MODE says otherwise.
Only the main process writes; the others hold no tracker. The engine's own records go to the
same run, under tags of their own in TensorBoard and W&B (`ENGINE_PREFIX`: "shardwise/loss"),
so the user's tags hold exactly what the user logged.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

ENGINE_PREFIX = "shardwise/"


def scalar_values(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`log()`'s values with each one-element tensor or array as a Python number (so every
    tracker records it); anything but numbers, strings, None and dicts or lists of them is
    refused in one line naming its key, on every process, before any tracker writes."""
    if not isinstance(values, Mapping):
        raise TypeError(f"log() takes a dict of name -> number, not {type(values).__name__}")
    return {k: _scalar(v, f"{prefix}{k}") for k, v in values.items()}


def _scalar(value: Any, name: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return scalar_values(value, name + "/")
    if isinstance(value, (list, tuple)):
        return [_scalar(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        if value.size == 1 if isinstance(value, (np.ndarray, np.generic)) else value.numel() == 1:
            return value.item()
        raise ValueError(
            f"log(): {name!r} is a {type(value).__name__} of shape {tuple(value.shape)}, not a scalar; "
            "log a number (e.g. .mean().item()) or one key per element"
        )
    raise ValueError(f"log(): {name!r} is a {type(value).__name__}, not a number; log numbers, strings, "
                     "or dicts of them")


def _scalars(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a (nested) record, flattened to "a/b" names, for scalar-only trackers."""
    out: dict[str, float] = {}
    for k, v in values.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_scalars(v, name + "/"))
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, dict) and "rank" in item:
                    out.update(_scalars({kk: vv for kk, vv in item.items() if kk != "rank"},
                                        f"{name}/rank{item['rank']}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


class Tracker:
    name = "tracker"

    def __init__(self, run: str, logging_dir: Path, config: dict[str, Any] | None) -> None:
        self.run, self.dir = run, logging_dir

    @property
    def tracker(self) -> Any:
        """The underlying object (the file, the SummaryWriter, the wandb run)."""
        return self

    def log(self, values: dict[str, Any], step: int | None) -> None:
        raise NotImplementedError

    def log_engine(self, record: dict[str, Any], step: int | None) -> None:
        """The engine's metrics record, its names under `ENGINE_PREFIX` (a user's `loss` or
        `epoch` tag never receives the engine's points)."""
        self.log({k if k == "step" else ENGINE_PREFIX + k: v for k, v in record.items()}, step)

    def finish(self) -> None:
        pass


class JSONLTracker(Tracker):
    """Appends one line per `log()`: {"step": ..., "time": ..., **values}."""

    name = "jsonl"

    def __init__(self, run: str, logging_dir: Path, config: dict[str, Any] | None) -> None:
        super().__init__(run, logging_dir, config)
        folder = logging_dir / run
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        self.file = self.path.open("a", encoding="utf-8")
        if config:
            (folder / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")

    @property
    def tracker(self) -> Any:
        return self.file

    def log(self, values: dict[str, Any], step: int | None) -> None:
        line = {"step": step, "time": round(time.time(), 3), **values}
        self.file.write(json.dumps(line, default=float) + "\n")
        self.file.flush()  # a line is whole on disk once log() returns

    def log_engine(self, record: dict[str, Any], step: int | None) -> None:
        self.log(record, step)  # a line of its own: `shardwise report` reads these names as they are

    def finish(self) -> None:
        self.file.close()


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run: str, logging_dir: Path, config: dict[str, Any] | None) -> None:
        super().__init__(run, logging_dir, config)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("log_with='tensorboard' needs the tensorboard package: "
                              "pip install 'shardwise[tensorboard]'") from e
        self.writer = SummaryWriter(str(logging_dir / run))
        if config:
            self.writer.add_text("config", json.dumps(config, indent=1, default=str))

    @property
    def tracker(self) -> Any:
        return self.writer

    def log(self, values: dict[str, Any], step: int | None) -> None:
        for k, v in _scalars(values).items():
            if k != "step":
                self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(Tracker):
    name = "wandb"

    def __init__(self, run: str, logging_dir: Path, config: dict[str, Any] | None, **init: Any) -> None:
        super().__init__(run, logging_dir, config)
        try:
            import wandb
        except ImportError as e:
            raise ImportError("log_with='wandb' needs the wandb package: pip install wandb") from e
        os.environ.setdefault("WANDB_MODE", "offline")  # never reach for the network unasked
        self.run_ = wandb.init(project=run, dir=str(logging_dir), config=config, **init)

    @property
    def tracker(self) -> Any:
        return self.run_

    def log(self, values: dict[str, Any], step: int | None) -> None:
        self.run_.log(_scalars(values), step=step)

    def finish(self) -> None:
        self.run_.finish()


_CLASSES: dict[str, type[Tracker]] = {
    "jsonl": JSONLTracker, "tensorboard": TensorBoardTracker, "wandb": WandBTracker
}


def make_trackers(names: tuple[str, ...], run: str, logging_dir: Path, config: dict[str, Any] | None,
                  init_kwargs: dict[str, dict[str, Any]]) -> list[Tracker]:
    out: list[Tracker] = []
    for name in names:
        if name == "wandb":
            out.append(WandBTracker(run, logging_dir, config, **init_kwargs.get(name, {})))
        else:
            out.append(_CLASSES[name](run, logging_dir, config))
    return out
