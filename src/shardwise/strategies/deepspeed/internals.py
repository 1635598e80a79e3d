"""DeepSpeed's internals that shardwise touches, each behind one function, keyed by ZeRO stage.

DeepSpeed has no public spelling for these. Keeping them here means a DeepSpeed upgrade is
checked in one module (`tests/test_layering.py` fails on a private name read anywhere else).
The stage is passed in by the strategy or runner that holds it; nothing here probes the
optimizer's class with `hasattr`; checked against DeepSpeed 0.19.8 (the version constraints.txt
pins); pyproject.toml allows deepspeed>=0.18,<0.20, and `supports_torch_style_backward` refuses
an engine without the torch-style backward that 0.18 introduced.

The ZeRO optimizer is `engine.optimizer`: `DeepSpeedZeroOptimizer` (stages 1 and 2,
`runtime/zero/stage_1_and_2.py`) or `DeepSpeedZeroOptimizer_Stage3` (`runtime/zero/stage3.py`;
`DeepSpeedZeRoOffload` for an engine without optimizer). What is touched:

Every stage
- `DeepSpeedEngine._support_torch_style_backward`: `loss.backward()` runs the engine's prologue and
  epilogue from hooks (deepspeed>=0.18 with a recent torch).
- `DeepSpeedEngine._backward_prologue` / `_backward_prologue_per_tensor`, the ZeRO optimizer's
  `clear_backward_seen_flag()` and `deepspeed.runtime.utils.register_output_backward_hooks`:
  what `DeepSpeedEngine.forward` adds around the module's forward so the backward that follows
  runs the engine's prologue (`as_engine_forward`: a submodule called on its own).
- the ZeRO optimizer's `optimizer` attribute: the user's torch optimizer it steps, replaced by
  `_KernelStep` for host_kernel="deepspeed" (a proxy that forwards every read and write).
- the ZeRO optimizer's `loss_scale` (read and set: num_items' rescale) and `clip_grad` (read and
  set: a script's clip bound for one step).
Stages 1 and 2
- `single_partition_of_fp32_groups`: this rank's fp32 partition of each group.
- `scaled_global_norm()`: the loss-scaled global gradient norm its step computes.
- `_hp_optimizer_states_linked` / `_lazy_init_hp_params_optimizer_state()`: the per-parameter views
  of the optimizer state (`safe_get_full_optimizer_state` reads them), linked after a first step.
AutoTP (`tensor_parallel.autotp_size`, `deepspeed.module_inject.layers`)
- a split Linear's `LinearLayer` (output features split: weight and bias by dim 0) or
  `LinearAllreduce` (input features: the weight by dim 1, the bias whole) with its `mp_group`,
  `tp_index`, `is_tp_parallel` and `_partition_sizes` (each rank's share, uneven allowed), and
  `_all_gather_shards(shard, sizes, dim)`: a whole tensor from every rank's part.
Stage 3
- `fp32_partitioned_groups_flat` / `sub_group_to_group_id`: this rank's fp32 partition of each
  sub-group, and the user's group each belongs to.
- `_get_norm_groups()` with `deepspeed.runtime.utils.combine_grad_norm_groups`: the global norm.
- `empty_partition_cache()`: every gathered parameter back to its partition.
- `deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`: a module-level list a forward
  pushes the module on and never pops (it would keep a released model alive).
- a parameter's `ds_shape`: its whole shape (the module holds an empty tensor).
- a parameter's `ds_tensor` / `ds_secondary_tensor`: its primary partition and ZeRO++ hpZ's
  secondary one (read by tests and reports only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from ..host_step import DeepSpeedAdam


def supports_torch_style_backward(engine: Any) -> bool:
    """`loss.backward()` drives this DeepSpeed engine (no `engine.backward(loss)` needed)."""
    return bool(engine._support_torch_style_backward)


def as_engine_forward(engine: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a submodule's forward, called outside the engine's forward) with
    what `DeepSpeedEngine.forward` does around the module for the backward that follows: the
    ZeRO optimizer's backward flag cleared, the engine's prologue hooked on the outputs (without
    it ZeRO-3's step finds no reduced gradients: `KeyError` in `_get_norm_groups`)."""
    from deepspeed.runtime.utils import register_output_backward_hooks

    engine.optimizer.clear_backward_seen_flag()
    out = fn(*args, **kwargs)
    register_output_backward_hooks(out, preprocess_once_fn=engine._backward_prologue,
                                   preprocess_per_tensor_fn=engine._backward_prologue_per_tensor)
    return out


def flat_partitions(zero_opt: Any, stage: int) -> list[tuple[torch.Tensor, int]]:
    """This rank's fp32 partitions and the user's group each belongs to. Stage 3 lends them to
    the optimizer's groups only while it steps, so its groups are empty at rest."""
    if stage >= 3:  # one per sub-group
        flats = zero_opt.fp32_partitioned_groups_flat
        return [(f, zero_opt.sub_group_to_group_id[i]) for i, f in enumerate(flats)]
    return [(f, i) for i, f in enumerate(zero_opt.single_partition_of_fp32_groups)]


def link_state_views(zero_opt: Any, stage: int) -> None:
    """Point DeepSpeed's per-parameter views at the optimizer state as it is now (stages 1-2
    link them lazily after the first step; stage 3 reads the state directly)."""
    if stage >= 3:
        return
    zero_opt._hp_optimizer_states_linked = False
    zero_opt._lazy_init_hp_params_optimizer_state()


def scaled_global_norm(zero_opt: Any, stage: int) -> torch.Tensor:
    """The loss-scaled global gradient norm DeepSpeed's own step computes (all ranks agree)."""
    if stage < 3:
        return cast(torch.Tensor, zero_opt.scaled_global_norm())
    from deepspeed.runtime.utils import combine_grad_norm_groups

    return cast(torch.Tensor, combine_grad_norm_groups(zero_opt._get_norm_groups()))


def loss_scale(zero_opt: Any) -> float:
    """The loss scale the ZeRO optimizer divides gradients by (1.0 without fp16's scaler)."""
    return float(zero_opt.loss_scale)


def set_loss_scale(zero_opt: Any, value: float) -> None:
    """Set the loss scale the next step divides the gradients (and their norm) by."""
    zero_opt.loss_scale = value


def clip_bound(zero_opt: Any) -> float:
    """The L2 bound the next step clips the gradients to (0: none)."""
    return float(zero_opt.clip_grad)


def set_clip_bound(zero_opt: Any, bound: float) -> None:
    """Set the L2 bound the next step clips the gradients to."""
    zero_opt.clip_grad = float(bound)


def step_through_kernel(zero_opt: Any, kernel: DeepSpeedAdam) -> None:
    """Make the ZeRO optimizer step the user's optimizer with DeepSpeed's CPUAdam `kernel`."""
    zero_opt.optimizer = _KernelStep(zero_opt.optimizer, kernel)


def release_gathered(zero_opt: Any, stage: int) -> None:
    """Every ZeRO-3 parameter back to its partition (the engine's own call would also run gc)."""
    if stage >= 3 and zero_opt is not None:
        zero_opt.empty_partition_cache()


def forget_module(module: torch.nn.Module) -> None:
    """Take `module` off ZeRO-3's module-level forward stack (DeepSpeed never pops it)."""
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The whole shape of `t`: ZeRO-3 leaves its parameters empty in the module (`ds_shape`)."""
    return tuple(getattr(t, "ds_shape", t.shape))


class _KernelStep:
    """The optimizer DeepSpeed's ZeRO optimizer steps under host_kernel="deepspeed": the user's
    own object, whose `step()` runs DeepSpeed's CPUAdam kernel over its groups and state. Every
    other attribute (param_groups, which DeepSpeed narrows to one group around each step, state,
    state_dict) reads and writes the user's object."""

    def __init__(self, optimizer: torch.optim.Optimizer, kernel: DeepSpeedAdam) -> None:
        object.__setattr__(self, "_user", optimizer)
        object.__setattr__(self, "_kernel", kernel)

    def step(self, closure: Any = None) -> None:
        """One step of the user's optimizer by the kernel (`closure` is not supported: unused)."""
        self._kernel.step(self._user)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._user, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._user, name, value)


def partition_numels(t: Any) -> tuple[int, int | None]:
    """The elements of this rank's ZeRO-3 partition of `t`, and of its ZeRO++ hpZ secondary
    partition (None without hpZ)."""
    secondary = getattr(t, "ds_secondary_tensor", None)
    return int(t.ds_tensor.numel()), None if secondary is None else int(secondary.numel())


# -- AutoTP -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TPSplit:
    """How AutoTP split one parameter: along `dim` over the layer's tp group."""

    layer: Any  # the AutoTP layer (a torch module of DeepSpeed's)
    dim: int

    @property
    def sizes(self) -> list[int]:
        """Every tp rank's share along `dim` (uneven allowed)."""
        return list(self.layer._partition_sizes)

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every tp rank's `part` (a collective of the tp group)."""
        return cast(torch.Tensor, self.layer._all_gather_shards(part.contiguous(), self.sizes, self.dim))

    def part(self, whole: torch.Tensor) -> torch.Tensor:
        """This tp rank's part of `whole`."""
        sizes, index = self.sizes, int(self.layer.tp_index)
        return whole.narrow(self.dim, sum(sizes[:index]), sizes[index])

    def whole_shape(self, part_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(part_shape)
        shape[self.dim] = sum(self.sizes)
        return tuple(shape)


def autotp_splits(module: torch.nn.Module) -> dict[int, TPSplit]:
    """Every parameter AutoTP split in `module` (by id), with how; {} without AutoTP."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    out: dict[int, TPSplit] = {}
    for m in module.modules():
        if not getattr(m, "is_tp_parallel", False):
            continue
        if isinstance(m, LinearAllreduce):  # the input features split; the bias stays whole
            out[id(m.weight)] = TPSplit(m, 1)
        elif isinstance(m, LinearLayer):  # the output features: weight and bias alike
            out.update((id(p), TPSplit(m, 0)) for p in m.parameters(recurse=False))
        elif any(True for _ in m.parameters(recurse=False)):
            raise NotImplementedError(f"AutoTP replaced a layer with {type(m).__name__}, whose split "
                                      "shardwise does not read; use backend='torch' for tensor parallelism "
                                      "of this model")
    return out
