"""Token-weighted loss: `engine.backward(loss_sum, num_items=n)`.

One process on the whole global batch computes `sum(per-token losses) / N`, N the tokens of the
whole optimizer step. A micro-batch on one process knows only its own count n, and the usual
per-micro-batch mean weights a token of a short micro-batch more than one of a long one. N is
known only when every micro-batch of every process has been counted, that is at the
accumulation boundary, after every backward: so the loss cannot be divided by it, the gradients
are rescaled instead.

Each backward propagates `loss_sum / grad_accum_steps`, as any loss, and adds n to this
process's count (no communication). At the boundary, before clipping and the optimizer step, ONE
all-reduce of the count (one float64) gives N, and every gradient is multiplied by
`world * grad_accum_steps / N`. Why that is exact: ddp, FSDP2 (zero1-3, offload) and DeepSpeed
all average gradients over the W processes, so the reduced gradient is
`d(sum of every process's loss_sum) / dθ / (W * A)`; times `W * A / N` it is the gradient of the
global token mean. A short window (the last of an epoch) divides by the same A, so it cancels too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..distributed.world import host_device

if TYPE_CHECKING:
    from ..distributed.world import DistInfo
    from ..strategies.base import OptimizerRunner


def _check(num_items: Any) -> None:
    if torch.is_tensor(num_items):
        # a count tensor (e.g. `(labels != -100).sum()`), not read here: no device sync per micro-batch
        ok = num_items.numel() == 1 and not num_items.is_complex() and num_items.dtype != torch.bool
    else:
        ok = isinstance(num_items, (int, float)) and not isinstance(num_items, bool)
        ok = ok and math.isfinite(num_items) and num_items >= 0
    if not ok:
        raise ValueError(f"backward(num_items={num_items!r}): num_items is the count of items (tokens) "
                         "the summed loss covers on this process in this micro-batch: a number >= 0 or a "
                         "one-element tensor")


class ItemCount:
    """This accumulation window's `num_items` on this process, and the factor agreed at its boundary."""

    def __init__(self) -> None:
        self.local: float | torch.Tensor = 0.0  # float64 tensor once a tensor count came
        self.weighted: bool | None = None  # the window's backwards pass num_items (None: no backward yet)
        self._factor: float | None = None  # world * accum / N, once agreed on this boundary
        self._scaled: set[int] = set()  # optimizers whose gradients got the factor

    def reset(self) -> None:
        self.local, self.weighted, self._factor = 0.0, None, None
        self._scaled.clear()

    def add(self, num_items: Any) -> None:
        """One backward's count (None: a backward of a mean loss). Checked before the backward runs."""
        if self._factor is not None:
            self.reset()  # the last boundary used its count: this backward starts a new window
        weighted = num_items is not None
        if self.weighted is not None and weighted != self.weighted:
            raise ValueError("backward(): pass num_items= to every backward of an accumulation window or to "
                             "none; this window mixes summed losses with num_items and mean losses without")
        if weighted:
            _check(num_items)
            n = num_items.detach().to(torch.float64) if torch.is_tensor(num_items) else float(num_items)
            self.local = n + self.local
        self.weighted = weighted

    def rescale(self, key: int, runner: OptimizerRunner, info: DistInfo, accum: int) -> None:
        """On the boundary, once for each optimizer (`key`): multiply its gradients by
        world * accum / N. The first call of a boundary agrees on N (a collective every process
        reaches: every process steps the same optimizers)."""
        if not self.weighted or key in self._scaled:
            return
        self._scaled.add(key)
        if self._factor is None:
            self._factor = self._agree(info, accum)
        if self._factor != 1.0:
            runner.scale_gradients(self._factor)

    def _agree(self, info: DistInfo, accum: int) -> float:
        via = host_device(info.device) if dist.is_initialized() else torch.device("cpu")
        total = torch.as_tensor(self.local, dtype=torch.float64).to(via).reshape(1)
        if dist.is_initialized() and info.world_size > 1:
            dist.all_reduce(total)
        n = float(total.item())
        # no item in the whole step: every summed loss was 0 and so is every gradient; any factor
        # leaves them as they are, 1.0 avoids a division by zero
        return info.world_size * accum / n if n > 0 else 1.0


def per_item(loss: torch.Tensor, num_items: Any) -> torch.Tensor:
    """What the metrics record of a backward: the loss itself, or with `num_items` this
    micro-batch's mean over its items on this process (no sync: a count tensor stays a tensor)."""
    if num_items is None:
        return loss
    n = num_items.clamp(min=1) if torch.is_tensor(num_items) else max(num_items, 1)
    return loss / n
