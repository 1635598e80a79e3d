"""What a run shows while it trains: loss, throughput, MFU, memory per process, progress.

The engine feeds a `Meter` without help from the script: the prepared DataLoader's batches
(samples, tokens), `engine.backward(loss)` (the loss, kept as a device tensor: no sync), the
optimizer steps (the step boundary). Every `log_every_steps` optimizer steps the meter makes ONE
collective (an all-gather of 8 float64 numbers per process) and hands one record to the trackers:

  step, epoch, loss (mean over processes and micro-steps of the interval's backward losses),
  samples_per_s, tokens_per_s, step_time_s (wall time per optimizer step over the interval),
  tflops_per_s and mfu (model FLOPs per token x tokens/s, against `peak_tflops` per process),
  memory: per process, tensor bytes by role (as `memory_report()` counts) and the peak (CUDA:
  the allocator's; CPU: the process high-water mark, ru_maxrss),
  grad_norm (the last clipped step's global norm, when the run clips), skipped_steps (fp16
  overflows so far) and loss_scale (fp16), from the engine.

Model FLOPs per token: `flops_per_token` when given, else 6 N (N trainable parameters: forward
and backward) plus, for a transformers model, 12 x layers x hidden x sequence (attention scores).
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.world import DistInfo
from .memory import MemoryReport

# dense bf16 peak TFLOP/s per device (vendor figures), for MFU when `peak_tflops` is not given
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
               "V100": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0}


def model_shape(model: nn.Module) -> tuple[int, int | None, int | None]:
    """(trainable parameters, layers, hidden size) of a model before it is sharded."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    return n, layers if isinstance(layers, int) else None, hidden if isinstance(hidden, int) else None


def model_flops_per_token(shape: tuple[int, int | None, int | None], seq_len: int | None) -> float:
    """6 N, plus 12 L H S for a transformers model with a known sequence length."""
    n, layers, hidden = shape
    flops = 6.0 * n
    if layers and hidden and seq_len:
        flops += 12.0 * layers * hidden * seq_len
    return flops


def peak_tflops(device: torch.device) -> float | None:
    """The table's peak for this device (None on CPU or an unknown device)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _batch_counts(batch: Any) -> tuple[int, int, int | None]:
    """(samples, tokens, sequence length) of a batch: dict batches count `input_ids`; otherwise
    the first tensor's first dimension is samples, and a 2-D integer tensor's elements are tokens."""
    tensors: list[torch.Tensor] = []
    if isinstance(batch, Mapping):
        if torch.is_tensor(batch.get("input_ids")):
            tensors = [batch["input_ids"]]
        else:
            tensors = [v for v in batch.values() if torch.is_tensor(v)]
    elif isinstance(batch, (list, tuple)):
        tensors = [v for v in batch if torch.is_tensor(v)]
    elif torch.is_tensor(batch):
        tensors = [batch]
    if not tensors or tensors[0].ndim == 0:
        return 0, 0, None
    t = tensors[0]
    if t.ndim >= 2 and not t.is_floating_point():
        return t.shape[0], t.numel(), t.shape[1]
    return t.shape[0], 0, None


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) * (1 if sys.platform == "darwin" else 1024)


class Meter:
    """Counts what passes through the engine and makes a record every `every` steps."""

    def __init__(
        self, info: DistInfo, every: int, *, peak: float | None, flops_per_token: float | None,
        same_samples: Callable[[], int] = lambda: 1,
    ) -> None:
        self.info, self.every = info, every
        # processes that take each batch (a tp x cp group: counted once), asked of the run's
        # layout (`ParallelDims.non_data_parallel`) at each record
        self.same_samples = same_samples
        self.peak = peak if peak is not None else peak_tflops(info.device)
        self.flops_per_token = flops_per_token  # None: from the model at prepare
        self._loss = torch.zeros((), dtype=torch.float64, device=info.device)
        self._losses = 0
        self._samples = 0
        self._tokens = 0
        self._seq: int | None = None
        self._pending: tuple[int, int, int | None] = (0, 0, None)
        self.grad_norm: torch.Tensor | None = None  # the last clipped step's norm (device tensor)
        self._since = time.perf_counter()
        self.steps_since_record = 0  # optimizer steps since the last record
        self.last_step = 0
        self.shape: tuple[int, int | None, int | None] | None = None  # the model's, before sharding

    def on_batch(self, batch: Any) -> None:
        """A prepared loader yields a batch; it counts once a backward uses it (so evaluation
        batches, which see no backward, do not count as training throughput)."""
        self._pending = _batch_counts(batch)

    def on_backward(self, loss: torch.Tensor) -> None:
        samples, tokens, seq = self._pending
        self._pending = (0, 0, None)
        self._samples += samples
        self._tokens += tokens
        self._seq = seq or self._seq
        if loss.numel() == 1:
            self._loss += loss.detach().to(self._loss.dtype).reshape(())  # stays on the device: no sync
            self._losses += 1

    def due(self, step: int) -> bool:
        """Optimizer steps were taken since the last call; True when a record is due."""
        if step <= self.last_step:
            return False
        self.steps_since_record += step - self.last_step
        self.last_step = step
        return step % self.every == 0

    def record(self, step: int, memory: MemoryReport | None, extra: dict[str, Any]) -> dict[str, Any]:
        """The interval's record (every process calls this: one all-gather)."""
        if self.info.device.type == "cuda":  # the interval's kernels done before its clock is read
            torch.cuda.synchronize(self.info.device)
        seconds = time.perf_counter() - self._since
        mem = memory or MemoryReport(0, 0, 0, 0)
        mine = torch.tensor(
            [self._loss.item(), self._losses, self._samples, self._tokens,
             mem.params, mem.grads, mem.optimizer, _peak_bytes(self.info.device)],
            dtype=torch.float64, device=self.info.device)
        if self.info.world_size > 1 and dist.is_initialized():
            rows = [torch.empty_like(mine) for _ in range(self.info.world_size)]
            dist.all_gather(rows, mine)
            table = torch.stack(rows).cpu()
        else:
            table = mine.cpu().unsqueeze(0)
        loss_sum, losses, samples, tokens = (float(table[:, i].sum()) for i in range(4))
        copies = self.same_samples()
        samples, tokens = samples / copies, tokens / copies  # (the loss: a mean, unchanged)
        steps = max(1, self.steps_since_record)
        out: dict[str, Any] = {"step": step, **extra}
        out["loss"] = loss_sum / losses if losses else None
        out["samples_per_s"] = samples / seconds if seconds > 0 else None
        out["tokens_per_s"] = tokens / seconds if seconds > 0 and tokens else None
        out["step_time_s"] = seconds / steps
        fpt = self.flops_per_token
        if fpt is None and self.shape is not None:
            fpt = model_flops_per_token(self.shape, self._seq)
        if fpt and out["tokens_per_s"]:
            out["tflops_per_s"] = fpt * out["tokens_per_s"] / 1e12
            out["mfu"] = out["tflops_per_s"] / (self.peak * self.info.world_size) if self.peak else None
        else:
            out["tflops_per_s"] = out["mfu"] = None
        # this process's copy
        out["grad_norm"] = float(self.grad_norm) if self.grad_norm is not None else None
        self.grad_norm = None
        out["memory"] = [
            {
                "rank": r,
                "params": int(row[4]),
                "grads": int(row[5]),
                "optimizer": int(row[6]),
                "peak": int(row[7]),
            }
            for r, row in enumerate(table.tolist())
        ]
        self._loss.zero_()
        self._losses = self._samples = self._tokens = self.steps_since_record = 0
        self._since = time.perf_counter()
        return out


def progress_wanted(setting: bool | None, is_main: bool) -> bool:
    """On the main process in a terminal, unless CI or the setting says otherwise."""
    if setting is not None:
        return setting and is_main
    return (
        is_main
        and sys.stderr.isatty()
        and not os.environ.get("CI")
        and not os.environ.get("SHARDWISE_NO_PROGRESS")
    )


class Progress:
    """A tqdm bar over optimizer steps: step, loss, tokens/s, ETA (per epoch when known)."""

    def __init__(self) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.bar: Any = None

    def start(self, total: int | None) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = self._tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)

    def advance(self, n: int) -> None:
        if self.bar is None:
            self.start(None)
        self.bar.update(n)

    def show(self, record: Mapping[str, Any]) -> None:
        if self.bar is None:
            return
        post = {}
        if record.get("loss") is not None:
            post["loss"] = f"{record['loss']:.4f}"
        if record.get("tokens_per_s"):
            post["tok/s"] = f"{record['tokens_per_s']:.0f}"
        if record.get("mfu") is not None and math.isfinite(record["mfu"]):
            post["mfu"] = f"{100 * record['mfu']:.1f}%"
        self.bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
