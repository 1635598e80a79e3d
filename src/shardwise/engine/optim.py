"""Prepared optimizers and schedulers, and rebinding an optimizer to sharded parameters.

The user's optimizer object stays the source of truth for hyperparameters: LR schedulers built
on it before or after `prepare` keep working. What changes is *what it steps*: FSDP2 replaces
parameters by DTensor shards (rebound here by name), zero1 and offload step inner copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config.tree import ConfigError, OptimizerConfig, SchedulerConfig
from ..strategies.base import OptimizerRunner, Strategy
from .step import StepState


def rebind_optimizer(
    optimizer: torch.optim.Optimizer,
    new_param: Callable[[torch.Tensor], torch.Tensor],
    rebind_state: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Point every group of `optimizer` at the parameters that replaced the ones it held.

    Class, hyperparameters and groups are untouched; existing state moves to the new parameter,
    in the form `rebind_state` gives it (cut to its shard where the strategy shards parameters).
    """
    for group in optimizer.param_groups:
        fresh = []
        for old in group["params"]:
            new = new_param(old)
            fresh.append(new)
            if new is not old and old in optimizer.state:
                state = optimizer.state.pop(old)
                optimizer.state[new] = {
                    k: rebind_state(new, v) if torch.is_tensor(v) else v for k, v in state.items()
                }
        group["params"] = fresh


class PreparedOptimizer(torch.optim.Optimizer):
    """The optimizer `prepare` returns: steps only on accumulation boundaries, handles fp16.

    `param_groups`, `defaults` and `state` are the user's optimizer's, so LR schedulers and
    code that reads or edits them behave as before. The step itself is the strategy's
    (`Strategy.optimizer_step`; the protocol is in `shardwise.engine.step`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        runner: OptimizerRunner,
        *,
        strategy: Strategy,
        state: StepState,
        max_grad_norm: float | None,
    ) -> None:
        # Deliberately no super().__init__: this object only delegates.
        self.optimizer = optimizer
        self.runner = runner
        self._strategy = strategy
        self._step_state = state
        self._max_grad_norm = max_grad_norm
        self._finite: bool | None = None  # fp16: verdict of this step's unscale, once computed
        self.step_was_skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def params(self) -> list[torch.Tensor]:
        return self.runner.params()

    def unscale_gradients(self) -> None:
        """fp16: divide this step's gradients by the loss scale, once. Before that, on the
        boundary, `backward(loss, num_items=n)`'s rescale to the global item mean, once."""
        state = self._step_state
        if state.sync:
            state.items.rescale(id(self), self.runner, self._strategy.info, state.grad_accum_steps)
        if self._finite is None:
            self._finite = self._strategy.precision.unscale(
                p.grad for p in self.params() if p.grad is not None
            )

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("prepared optimizers take no closure; compute the loss in your loop")
        state = self._step_state
        if not state.sync:
            return  # a micro-step inside accumulate(): gradients keep accumulating
        first = state.record_step(id(self))
        self.unscale_gradients()
        finite, self._finite = self._finite, None
        clip = None if state.clipped else self._max_grad_norm  # each optimizer clips its own parameters
        result = self._strategy.optimizer_step(self.runner, clip=clip, finite=finite)
        self.step_was_skipped = not result.applied
        state.skipped_steps += int(first and not result.applied)  # once per boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._step_state.sync:
            self.runner.zero_grad(set_to_none)
            self._step_state.end_step()

    def state_dict(self) -> dict[str, Any]:
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.runner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("add parameter groups before prepare(); a prepared optimizer's groups are fixed")

    def __getattr__(self, name: str) -> Any:
        """The user's optimizer's own public names (schedule-free's `train()`/`eval()`, a
        custom method or attribute) on the prepared one, acting on its `param_groups`."""
        if name.startswith("_") or name == "optimizer":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"Prepared({self.optimizer!r})"


class PreparedScheduler:
    """Steps the user's LR scheduler on real optimizer steps only (not inside an accumulation,
    not after an fp16 overflow), `steps_per_call` times each.

    The rule, in one place: `Engine` steps it once per optimizer step (`steps_per_call=1`): the
    schedule counts optimizer steps, as in a single-process run. `Accelerator` steps it once
    per process per optimizer step (`steps_per_call=num_processes`, 1 with `split_batches`), as
    Accelerate does, so schedules sized for Accelerate end where they end there.
    """

    def __init__(self, scheduler: Any, optimizers: list[PreparedOptimizer], state: StepState,
                 steps_per_call: int = 1) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self._step_state = state
        self.steps_per_call = steps_per_call
        self.step_with_optimizer = True  # Accelerator(step_scheduler_with_optimizer=False): every call steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._step_state.sync:
            return
        if self.optimizers and all(o.step_was_skipped for o in self.optimizers):
            return  # fp16 overflow: the weights did not move, neither does the schedule
        for _ in range(self.steps_per_call):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR: never past its end
            if isinstance(total, int) and getattr(self.scheduler, "_step_count", 0) > total:
                return
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


# "auto" values with no script object to take them from: the Hugging Face Trainer's defaults,
# which is what the DeepSpeed JSONs written for it expect.
_AUTO_OPTIMIZER = {"lr": 5e-5, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer a config describes, over `model` (no weight decay on biases and norms)."""
    v: dict[str, Any] = {k: _AUTO_OPTIMIZER[k] if getattr(cfg, k) == "auto" else getattr(cfg, k)
                         for k in _AUTO_OPTIMIZER}
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": v["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.type == "SGD":
        return torch.optim.SGD(groups, lr=v["lr"], momentum=cfg.momentum)
    adam = torch.optim.AdamW if cfg.type == "AdamW" or cfg.adam_w_mode else torch.optim.Adam
    return adam(groups, lr=v["lr"], betas=tuple(v["betas"]), eps=v["eps"])


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as a LambdaLR over optimizer steps."""
    base = optimizer.param_groups[0]["lr"]
    top = base if cfg.warmup_max_lr == "auto" else float(cfg.warmup_max_lr)
    low = 0.0 if cfg.warmup_min_lr == "auto" else float(cfg.warmup_min_lr)
    warm = 0 if cfg.warmup_num_steps == "auto" else int(cfg.warmup_num_steps)
    if cfg.total_num_steps != "auto":
        total = int(cfg.total_num_steps)
    elif steps_per_epoch is not None:
        total = steps_per_epoch
    else:
        raise ConfigError(
            "scheduler.total_num_steps is \"auto\" but no DataLoader was prepared with the model "
            "to count the steps of an epoch; set scheduler.total_num_steps or prepare the DataLoader"
        )
    for group in optimizer.param_groups:
        group["lr"] = top

    def lr_at(step: int) -> float:
        if step < warm:
            if cfg.warmup_type == "log" and warm > 1:
                frac = math.log(step + 1) / math.log(warm)
            else:
                frac = step / max(1, warm)
            return low + (top - low) * min(1.0, frac)
        if cfg.type == "WarmupLR":
            return top
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if cfg.type == "WarmupDecayLR":
            return top * (1.0 - progress)
        return top * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / top if top else 0.0)
