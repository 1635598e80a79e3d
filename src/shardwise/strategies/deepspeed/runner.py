"""The optimizer runner of `backend="deepspeed"`: one prepared optimizer, one DeepSpeed engine.

The user's optimizer is the one DeepSpeed's ZeRO optimizer steps: its groups hold this rank's
fp32 partitions. Checkpoints read and write whole tensors through DeepSpeed's public
`safe_get/set_full_optimizer_state`, in torch's `get_optimizer_state_dict` layout, so a
checkpoint moves between backends, stages and world sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..base import OptimizerRunner, zero_step
from ..host_step import threads
from . import internals as ds

Relayout = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (parameter, tensor) -> tensor


class DeepSpeedRunner(OptimizerRunner):
    """One prepared optimizer = one DeepSpeed engine's optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, ds_engine: Any,
                 names: list[list[str]], *, stage: int, whole: Relayout = lambda p, v: v,
                 part: Relayout = lambda p, v: v) -> None:
        self.optimizer = optimizer  # the user's; its groups now hold this rank's fp32 partitions
        self.module = module  # the user's module, which `ds_engine` holds
        self.ds_engine = ds_engine
        self.stage = stage  # the ZeRO stage: where DeepSpeed keeps the partitions differs
        self.group_names = names  # parameter names per group, as the user made them
        self.clip = ds.clip_bound(ds_engine.optimizer)  # the config's bound (0: none)
        self._rescaled: tuple[float, float, float] | None = None  # loss scale kept, set, factor
        # AutoTP: a state tensor of a split parameter whole (a collective of its tp group), and
        # this rank's part of a whole one
        self._whole, self._part = whole, part

    host_threads: int | None = None  # offload: the host step's threads

    def step(self) -> None:
        with threads(self.host_threads):
            self.ds_engine.step()  # on the boundary: reduce (stage 1), clip, step, zero the grads

    def params(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ds_engine.optimizer.zero_grad(set_to_none=set_to_none)

    def scale_gradients(self, factor: float) -> None:
        """ZeRO-2/3 gradients live in DeepSpeed's partition buffers (on the host with offload),
        which no public call scales. What every ZeRO stage does read is its loss scale: its
        step divides the partitions by it (`unscale_and_clip_grads`), and its norm, clipping
        included, is taken of the gradients divided by it. So the factor goes there, for this
        step: the loss scale is divided by it here and restored after the step (`restore_scale`)."""
        opt = self.ds_engine.optimizer
        kept = ds.loss_scale(opt)
        ds.set_loss_scale(opt, kept / factor)  # bf16/fp32: DeepSpeed's static scaler, 1.0 otherwise
        self._rescaled = (kept, ds.loss_scale(opt), factor)

    def restore_scale(self) -> None:
        """The loss scale as before `scale_gradients`; fp16's dynamic scaler keeps its own verdict
        on this step (a halving or growth is multiplied back by the same factor)."""
        if self._rescaled is None:
            return
        (kept, scaled, factor), self._rescaled = self._rescaled, None
        opt = self.ds_engine.optimizer
        now = ds.loss_scale(opt)
        ds.set_loss_scale(opt, kept if now == scaled else now * factor)

    def end_step(self) -> None:
        """After a step: the config's clip bound again (a script's bound lasts one step), and the
        loss scale as before num_items' rescale (which lasts one step too)."""
        ds.set_clip_bound(self.ds_engine.optimizer, self.clip)
        self.restore_scale()

    def tensors(self) -> list[torch.Tensor]:
        """fp32 partitions, their gradients and the optimizer state this rank keeps."""
        out = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        for f, _ in self._flat_partitions():
            out += [f] + ([f.grad] if f.grad is not None else [])
        return out

    def state_dict(self) -> dict[str, Any]:
        return dict(self.ds_engine.optimizer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ds_engine.optimizer.load_state_dict([state])

    def _flat_partitions(self) -> list[tuple[torch.Tensor, int]]:
        """This rank's fp32 partitions and the user's group each belongs to."""
        return ds.flat_partitions(self.ds_engine.optimizer, self.stage)

    def _ensure_state(self) -> None:
        """Give a fresh optimizer its state (`zero_step` over this rank's partitions) and point
        DeepSpeed's per-parameter views at it (stages 1-2 link them after the first step)."""
        flats = self._flat_partitions()
        if not any(f in self.optimizer.state for f, _ in flats):
            per_group: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
            for f, gi in flats:
                per_group[gi].append(f)
            zero_step(self.optimizer, per_group)  # offload's host gradient buffers stay attached
        ds.link_state_views(self.ds_engine.optimizer, self.stage)

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        """torch's `get_optimizer_state_dict` layout with whole tensors, so a checkpoint moves
        between backends, stages and world sizes (each is gathered: a collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self._ensure_state()
        params = dict(self.module.named_parameters())
        step = self._step()
        state: dict[str, Any] = {}
        groups = []
        keys = _state_keys(self.optimizer)
        for names, group in zip(self.group_names, self.optimizer.param_groups):
            for name in names:
                p = params[name]
                entry = {k: self._whole(p, safe_get_full_optimizer_state(p, k)) for k in keys}
                if step is not None and all(torch.is_tensor(v) for v in entry.values()):
                    state[name] = {"step": step.clone(), **{k: v.detach().cpu() for k, v in entry.items()}}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})
        return {"state": state, "param_groups": groups}

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        self._ensure_state()
        params = dict(self.module.named_parameters())
        for name, entry in state["state"].items():
            for key, value in entry.items():
                if key != "step":
                    p = params[name]
                    safe_set_full_optimizer_state(p, self._part(p, value).to(torch.float32), key)
        steps = [e["step"] for e in state["state"].values() if "step" in e]
        for st in self.optimizer.state.values():
            if "step" in st and steps:
                if torch.is_tensor(st["step"]):
                    st["step"].copy_(steps[0])
                else:
                    st["step"] = steps[0]
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _step(self) -> torch.Tensor | None:
        for st in self.optimizer.state.values():
            if "step" in st:
                s = st["step"]
                return s.detach().cpu().float() if torch.is_tensor(s) else torch.tensor(float(s))
        return None


def _state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    for st in optimizer.state.values():
        return [k for k, v in st.items() if k != "step" and torch.is_tensor(v) and v.dim() > 0]
    return []
