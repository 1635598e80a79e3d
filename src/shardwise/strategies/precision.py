"""fp32 / bf16 / fp16 policies and dynamic loss scaling: the precision component a strategy holds.

In every mode the weights the optimizer updates, the gradients it reads and its state stay fp32:
only the forward/backward compute runs in the low-precision dtype. On the torch backend, every
prepared model's forward runs under `torch.autocast` (whose fp32 master weights are the module's
own parameters); FSDP strategies also gather parameters in that dtype (`MixedPrecisionPolicy`,
fp32 reduce-scatter). fp16 adds a `DynamicLossScaler`. A strategy that casts and scales by itself
(DeepSpeed) holds a `Precision` subclass that leaves both to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.tree import ConfigError, LossScaleConfig
from ..distributed.internals import local_tensor

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def check_device_supports(precision: str, device: torch.device) -> None:
    """Refuse a precision the device cannot compute in, before any model is touched."""
    dtype = DTYPES[precision]
    if dtype is torch.float32:
        return
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision='bf16' is not supported by {torch.cuda.get_device_name(device)}; "
            "use precision='fp16' or 'fp32'"
        )
    try:
        a = torch.ones(8, 8, device=device, dtype=dtype)
        with torch.autocast(device.type, dtype=dtype):
            (a @ a).sum().item()
    except RuntimeError as err:
        raise ConfigError(
            f"precision={precision!r} cannot run on device {device}: {err}. "
            "Use precision='fp32' (or 'bf16' where supported); from the command line: --precision fp32"
        ) from None


class Precision:
    """The compute dtype of a run: the autocast that applies it, and fp16's loss scaler."""

    def __init__(self, name: str, device: torch.device, loss_scale: LossScaleConfig | None = None) -> None:
        self.name = name
        self.dtype = DTYPES[name]
        self.device = device
        self.scaler = DynamicLossScaler(loss_scale or LossScaleConfig(), device) if name == "fp16" else None

    @property
    def is_mixed(self) -> bool:
        return self.dtype is not torch.float32

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.is_mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def apply_to(self, module: nn.Module) -> None:
        """Run `module`'s forward in the compute dtype (fp32 weights stay)."""
        if not self.is_mixed:
            return
        forward = module.forward
        autocast = self.autocast

        def autocast_forward(_self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with autocast():
                return forward(*args, **kwargs)

        module.forward = MethodType(autocast_forward, module)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool | None:
        """fp16: unscale in place and return whether every rank's gradients are finite;
        None when nothing is scaled."""
        return self.scaler.unscale_and_check(grads) if self.scaler is not None else None

    def update(self, finite: bool | None) -> None:
        """After a step: the scaler grows or backs off on this step's verdict."""
        if self.scaler is not None and finite is not None:
            self.scaler.update(finite)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, float | int] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, float | int] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


class DynamicLossScaler:
    """fp16 loss scaling that agrees across ranks.

    With sharded gradients each rank sees only its shard, so the inf/nan verdict is all-reduced
    (MAX) before anyone decides to skip: every rank skips the same step, and the scale stays
    identical everywhere. The state (scale, growth tracker) is part of the engine's state.
    """

    def __init__(self, cfg: LossScaleConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.scale = float(cfg.init_scale)
        self._good_steps = 0
        self._hysteresis = cfg.hysteresis  # overflows still tolerated before backing off

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide gradients by the scale in place; return True when every rank's are finite."""
        inv = 1.0 / self.scale
        found_inf = torch.zeros((), device=self.device)
        for g in grads:
            local = _local(g)
            local.mul_(inv)
            if local.numel() and not torch.isfinite(local).all():
                found_inf.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() == 0)

    def update(self, finite: bool) -> None:
        """After a step whose verdict was `finite` (the step counts its skips: `StepState`)."""
        if not self.cfg.dynamic:
            return
        if finite:
            self._good_steps += 1
            if self._good_steps >= self.cfg.growth_interval:
                self.scale *= self.cfg.growth_factor
                self._good_steps = 0
                self._hysteresis = self.cfg.hysteresis
            return
        self._good_steps = 0
        if self._hysteresis > 1:
            self._hysteresis -= 1  # skip the step, keep the scale (DeepSpeed's "hysteresis")
        else:
            self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "hysteresis": self._hysteresis,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis = int(state.get("hysteresis", self.cfg.hysteresis))
