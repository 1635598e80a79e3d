"""The typed configuration tree: the single source of truth for how a run is sharded.

Every field carries a docstring right under it; later these become the CLI help. Values are
validated at construction, so a bad value is refused before any process group, model or
optimizer is touched.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

Strategy = Literal["ddp", "zero1", "zero2", "zero3"]
Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "optimizer", "params"]

STRATEGIES: tuple[str, ...] = get_args(Strategy)
PRECISIONS: tuple[str, ...] = get_args(Precision)
OFFLOADS: tuple[str, ...] = get_args(Offload)


class ConfigError(ValueError):
    """A configuration value that shardwise refuses; the message names the field and the fix."""


def _choice(field_name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{field_name}={value!r} is not valid{hint}; choose one of: {', '.join(choices)}"
        )
    return value


@dataclass(kw_only=True, slots=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored by fp32 and bf16)."""

    init_scale: float = 2.0**16
    """Loss scale of the first step."""
    growth_factor: float = 2.0
    """Factor the scale grows by after `growth_interval` steps without inf/nan gradients."""
    backoff_factor: float = 0.5
    """Factor the scale shrinks by when a step's gradients hold inf/nan (that step is skipped)."""
    growth_interval: int = 2000
    """Number of consecutive finite steps before the scale grows."""
    min_scale: float = 1.0
    """The scale never backs off below this value."""

    def __post_init__(self) -> None:
        if self.init_scale <= 0 or self.min_scale <= 0:
            raise ConfigError("loss_scale.init_scale and loss_scale.min_scale must be > 0")
        if not (0 < self.backoff_factor < 1):
            raise ConfigError(
                f"loss_scale.backoff_factor={self.backoff_factor} must lie strictly between 0 and 1"
            )
        if self.growth_factor <= 1:
            raise ConfigError(f"loss_scale.growth_factor={self.growth_factor} must be > 1")
        if self.growth_interval < 1:
            raise ConfigError(f"loss_scale.growth_interval={self.growth_interval} must be >= 1")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How an `Engine` shards, casts and accumulates. Keywords of `Engine(...)` fill this tree."""

    strategy: Strategy = "ddp"
    """ddp: full replicas, gradients all-reduced. zero1: + optimizer states sharded.
    zero2: + gradients sharded. zero3: + parameters sharded (gathered per block for compute)."""
    precision: Precision = "fp32"
    """fp32; bf16 (bf16 compute, fp32 master weights, reduction and optimizer state);
    fp16 (as bf16, plus dynamic loss scaling)."""
    offload: Offload = "none"
    """none; optimizer: optimizer states and the optimizer step live on the host (zero1-3);
    params: parameter shards also live on the host between uses (zero3 only)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; gradients are communicated only on the last one."""
    seed: int = 0
    """Seeds python, numpy and torch on every process, and the DataLoader shuffling."""
    cpu: bool = False
    """Run on CPU processes (gloo) even when GPUs are present."""
    wrap: tuple[str | type, ...] = ()
    """Module classes (or class names) sharded as units (zero2/zero3). Empty: detect the
    repeated blocks (a transformer's layers) automatically."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    offload_bucket_numel: int = 2**24
    """Optimizer offload pipelines gradient copies, host steps and parameter copies in buckets
    of about this many elements."""

    def __post_init__(self) -> None:
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("offload", self.offload, OFFLOADS)
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ConfigError(f"grad_accum_steps={self.grad_accum_steps!r} must be an integer >= 1")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        if self.offload == "params" and self.strategy != "zero3":
            raise ConfigError(
                f"offload='params' needs strategy='zero3' (got strategy={self.strategy!r}): only "
                "stage 3 shards parameters. Use offload='optimizer' with zero1/zero2, or zero3."
            )
        if self.offload == "optimizer" and self.strategy == "ddp":
            raise ConfigError(
                "offload='optimizer' needs a sharded strategy (zero1, zero2 or zero3), "
                "got strategy='ddp'"
            )
        if self.offload_bucket_numel < 1:
            raise ConfigError(f"offload_bucket_numel={self.offload_bucket_numel} must be >= 1")
        if isinstance(self.wrap, (str, type)):
            self.wrap = (self.wrap,)
        self.wrap = tuple(self.wrap)
        for item in self.wrap:
            if not isinstance(item, (str, type)):
                raise ConfigError(f"wrap entries must be module classes or class names, got {item!r}")
        if isinstance(self.loss_scale, dict):
            self.loss_scale = LossScaleConfig(**self.loss_scale)


def field_names(cls: type) -> list[str]:
    """Names of a config dataclass's fields (used to suggest the closest valid key)."""
    return [f.name for f in fields(cls)]


def make_config(**overrides: Any) -> EngineConfig:
    """Build an `EngineConfig` from keywords, refusing unknown ones with the closest valid name."""
    valid = field_names(EngineConfig)
    for key in overrides:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown setting {key!r}{hint}; valid settings: {', '.join(valid)}")
    return EngineConfig(**overrides)
