"""The engine's eyes: its `Meter`, the trackers (`init_trackers`/`log`/`get_tracker`) and the
progress bar, behind one object the engine delegates to (`shardwise.runtime.metrics`,
`shardwise.runtime.trackers`). Records are made on every process (one all-gather each) and written on
the main process only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.tree import ObservationConfig
from ..distributed.world import DistInfo
from .memory import MemoryReport
from .metrics import Meter, Progress, model_shape, progress_wanted
from .trackers import Tracker, make_trackers, scalar_values

log = logging.getLogger("shardwise")


class Observer:
    def __init__(self, cfg: ObservationConfig, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        self.names = cfg.log_with  # checked and normalized by the config
        self.trackers: list[Tracker] = []
        self.started = False
        self.meter = Meter(info, max(1, cfg.log_every_steps), peak=cfg.peak_tflops,
                           flops_per_token=cfg.flops_per_token)  # same_samples: the engine's layout
        show = progress_wanted(cfg.progress, info.is_main)
        if info.world_size > 1 and dist.is_initialized():  # every process must agree to make records
            flag = torch.tensor([int(show)], device=info.device)
            dist.broadcast(flag, src=0)
            show_any = bool(flag.item())
        else:
            show_any = show
        self.progress = Progress() if show else None
        self.active = cfg.log_every_steps > 0 and (bool(self.names) or show_any)
        self.epoch = 0
        self.root: Path | None = None  # where the trackers' runs go (Accelerator: Accelerate's logging_dir)

    # -- trackers (Accelerate's verbs) ------------------------------------------------------
    @property
    def logging_dir(self) -> Path:
        return self.root if self.root is not None else Path(self.cfg.project_dir or ".") / "logs"

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        self.started = True
        if self.info.is_main and self.names:
            self.trackers = make_trackers(self.names, project_name, self.logging_dir, config,
                                          init_kwargs or {})

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None = None) -> None:
        if not self.started and self.names:
            self.init_trackers("shardwise")
        for t in self.trackers:
            t.log(values, step)

    def _log_record(self, record: dict[str, Any], step: int) -> None:
        if not self.started and self.names:
            self.init_trackers("shardwise")
        for t in self.trackers:
            t.log_engine(record, step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        for t in self.trackers:
            if t.name == name:
                return t.tracker if unwrap else t
        if self.info.is_main and name in self.names:
            raise ValueError(f"tracker {name!r} has not started: call init_trackers() first")
        return None  # other processes hold no tracker (as in Accelerate, a no-op stand-in there)

    # -- the engine's own metrics -----------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """The first prepared model that trains is the one whose FLOPs MFU counts (sized before
        sharding); a frozen reference prepared before it is not."""
        if self.meter.shape is None and any(p.requires_grad for p in model.parameters()):
            self.meter.shape = model_shape(model)

    def start_epoch(self, steps: int | None) -> None:
        if self.progress is not None:
            self.progress.start(steps)

    def on_batch(self, batch: Any) -> None:
        if self.active:
            self.meter.on_batch(batch)

    def on_backward(self, loss: torch.Tensor) -> None:
        if self.active:
            self.meter.on_backward(loss)

    def on_clip(self, norm: torch.Tensor | None) -> None:
        """The gradient norm of a clipped step (kept as a tensor: read at the next record)."""
        if self.active and norm is not None:
            self.meter.grad_norm = norm.detach()

    def at_boundary(self, step: int, probe: Callable[[], tuple[MemoryReport | None, dict[str, Any]]],
                    *, final: bool = False) -> None:
        """Called by every process between optimizer steps; makes a record when one is due.
        `probe` gives the engine's side of it: memory by role and extra figures."""
        if not self.active:
            return
        before = self.meter.last_step
        due = self.meter.due(step)
        if self.progress is not None and step > before:
            self.progress.advance(step - before)
        if not (due or (final and self.meter.steps_since_record)):
            return
        report, extra = probe()
        record = self.meter.record(step, report, {"epoch": self.epoch, **extra})
        if self.progress is not None:
            self.progress.show(record)
        self._log_record(record, step)

    def close(self, step: int, probe: Callable[[], tuple[MemoryReport | None, dict[str, Any]]]) -> None:
        self.at_boundary(step, probe, final=True)
        if self.progress is not None:
            self.progress.close()
        for t in self.trackers:
            t.finish()
        self.trackers = []


class TrackerVerbs:
    """Accelerate's tracker verbs, for the engine (which holds the `Observer`)."""

    _observer: Observer

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the `log_with` trackers (main process) for a run named `project_name`."""
        self._observer.init_trackers(project_name, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, Any] | None = None) -> None:
        """Send `values` to every tracker (main process; a no-op elsewhere). Values are numbers
        (one-element tensors and arrays count), strings, or dicts of them; anything else is refused
        on every process, naming its key."""
        self._observer.log(scalar_values(values), step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (its underlying object with unwrap=True)."""
        return self._observer.get_tracker(name, unwrap)
