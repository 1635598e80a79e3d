"""The narrow interface the Engine's session talks to. Nothing outside `strategies/` compares names.

A `Strategy` turns models into their distributed form, holds the run's `Precision`, and performs
the optimizer step (`optimizer_step`: clip, skip on fp16 overflow, update; see `shardwise.engine.step`
for the whole protocol). An `OptimizerRunner` is how one optimizer's update happens under it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from ..config.parallelism import DIMS, resolve_shard_group, resolve_sizes
from ..config.tree import ConfigError, EngineConfig
from ..distributed.mesh import ParallelDims
from ..distributed.world import DistInfo
from ..weights.loading import Reader, copy_into, full_shapes
from ..weights.materialize import Places, allocate, materialize
from .expert_parallel import check_layout as check_expert_layout
from .host_step import DeepSpeedAdam, threads
from .precision import Precision
from .tensor_parallel import clip_over_meshes


@dataclass(frozen=True)
class EmptyModel:
    """How to fill a model built on the meta device (see `shardwise.weights.materialize`)."""

    places: Places
    """Where its meta tensors sit, each with its constructor's recorded initialization."""
    rng: torch.Tensor | None
    """The CPU generator state its initializers replay (the same on every process)."""
    skip: frozenset[str] = frozenset()
    """Tensors that pretrained weights fill instead."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one `Strategy.optimizer_step` did."""

    applied: bool
    """The parameters were updated (False: an fp16 overflow skipped the step on every rank)."""


def layout(cfg: EngineConfig, info: DistInfo, *, shards: bool, supported: frozenset[str]) -> ParallelDims:
    """The run's `ParallelDims`: the config's `parallelism` sizes (and shard_group_size, resolved
    into them by `config.parallelism.resolve_sizes`) on this world. `shards`: the strategy shards
    over dp_shard (a shard_group_size is resolved for it; ddp ignores one). A dimension of more
    than one process outside `supported` is refused in one line, and expert parallelism under a
    strategy or layout it does not split in (`expert_parallel.check_layout`) before any size."""
    world, local = info.world_size, info.local_world_size
    check_expert_layout(cfg.parallelism, cfg.sharding.strategy, cfg.sharding.backend)  # (before the sizes)
    given = shards and cfg.sharding.shard_group_size is not None
    group = resolve_shard_group(cfg.sharding.shard_group_size, world, local) if given else None
    sizes = resolve_sizes(cfg.parallelism, shards=shards, shard_group=group, world=world, local_world=local,
                          group_said=cfg.sharding.shard_group_size)
    unsupported = [f"{d}={getattr(sizes, d)}" for d in DIMS if getattr(sizes, d) > 1 and d not in supported]
    if unsupported:
        raise ConfigError(f"parallelism {', '.join(unsupported)}: backend {cfg.sharding.backend} does not "
                          "split "
                          f"along {'it' if len(unsupported) == 1 else 'them'} (it splits "
                          f"{', '.join(d for d in DIMS if d in supported)}); set "
                          f"{', '.join(u.split('=')[0] for u in unsupported)} to 1")
    return ParallelDims(sizes.dp_replicate, sizes.dp_shard, world, info.device.type, tp=sizes.tp, cp=sizes.cp,
                        ep=sizes.ep)


def zero_step(optimizer: torch.optim.Optimizer, params: Sequence[Sequence[torch.Tensor]]) -> None:
    """Give `optimizer` its state without moving a weight: one step at lr 0 with zero gradients
    over `params` (one list per param group, in place of the groups' own), as torch DCP does for
    a fresh optimizer. Groups, learning rates and gradients are restored afterwards."""
    groups = optimizer.param_groups
    kept = [(g["params"], g["lr"]) for g in groups]
    grads = [[p.grad for p in ps] for ps in params]
    try:
        for group, ps in zip(groups, params):
            group["params"], group["lr"] = list(ps), 0.0
            for p in ps:
                p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, (ps, lr) in zip(groups, kept):
            group["params"], group["lr"] = ps, lr
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, gs):
                p.grad = g


class OptimizerRunner(ABC):
    """How one optimizer's step happens under a strategy (in place, sharded, or on the host)."""

    @abstractmethod
    def step(self) -> None:
        """Apply one update from the current gradients."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of every parameter the optimizer updates."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def params(self) -> list[torch.Tensor]:
        """The (prepared) parameters the user's optimizer updates, in group order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def owner_params(self) -> list[torch.Tensor]:
        """Parameters of the model this optimizer updates (to find the model it belongs to)."""
        return self.params()

    def reload_params(self) -> None:
        """The model's parameters were overwritten (pretrained weights): refresh any copy of
        them the runner keeps (host masters)."""
        return

    @torch.no_grad()
    def scale_gradients(self, factor: float) -> None:
        """Multiply this step's gradients by `factor` (`shardwise.engine.items`), before clipping
        and the step."""
        for p in self.params():
            if p.grad is not None:
                p.grad.mul_(factor)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this runner keeps besides the model's parameters and gradients."""
        return [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]

    @abstractmethod
    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, each tensor whole or a DTensor of its
        parameter's layout, so any strategy and world size can load it (torch DCP's format)."""

    @abstractmethod
    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take back what `checkpoint_state` gave (filled in place by the checkpoint reader)."""


class InPlaceRunner(OptimizerRunner):
    """The user's optimizer steps the (possibly sharded) model parameters directly."""

    def __init__(self, optimizer: torch.optim.Optimizer, *,
                 host: tuple[int | None, DeepSpeedAdam | None] = (None, None)) -> None:
        self.optimizer = optimizer
        # parameters on the host (offload, a CPU device): the step's threads, and the kernel of
        # host_kernel="deepspeed" (None: the optimizer's own step)
        self.host_threads, self.kernel = host

    def step(self) -> None:
        with threads(self.host_threads):
            if self.kernel is not None:
                self.kernel.step(self.optimizer)
            else:
                self.optimizer.step()

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        # initialises a fresh optimizer's state, so it can serve as a template to load into
        return get_optimizer_state_dict(model, self.optimizer)

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(model, self.optimizer, state)


class Strategy(ABC):
    """Turns a model into its data-parallel form and performs the optimizer step on it: the last
    step of `strategies.steps.parallelize` (tensor parallelism, activation checkpointing and
    compile come first, each on its own view of the mesh), and what differs per backend (setup,
    no_sync, the optimizer runner, state).

    `dims` (`distributed.mesh.ParallelDims`, resolved once by `layout` from the config's
    `parallelism` sizes) is the run's layout and the one owner of its mesh and process groups;
    `mesh` is the mesh the strategy shards on and `process_groups()` its (shard, replicate)
    groups, for whoever counts or checkpoints by group.
    """

    mesh: DeviceMesh | None = None
    """`dims.mesh`: 1-D over every process, or 2-D ("dp_replicate", "dp_shard") under hybrid
    sharding; None where the strategy shards nothing itself (ddp, the DeepSpeed engine)."""
    supported_dims: frozenset[str] = frozenset({"dp_replicate", "dp_shard", "cp", "tp", "ep"})
    """The mesh dimensions this backend splits along; a size above 1 on any other is refused."""
    own_steps: frozenset[str] = frozenset()
    """Model-parallel steps the backend applies itself when it builds a model (DeepSpeed: its
    AutoTP splits the layers), which `strategies.steps` then leaves to it."""

    def __init__(self, cfg: EngineConfig, info: DistInfo, *, shards: bool) -> None:
        self.cfg = cfg
        self.info = info
        self.shards = shards
        """The strategy shards state over a dp_shard dimension (ddp: False, its ranks are replicas)."""
        # resolved (a size that does not divide the world, or a dimension this backend does not
        # split, refused in one line) before any model is touched
        self.dims = layout(cfg, info, shards=shards, supported=self.supported_dims)
        self.shard_group_size = self.dims.dp_shard
        """Data-parallel ranks per sharding group (informative: the checkpoint's metadata)."""
        self.precision = self.make_precision()

    def process_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """(shard group, replicate group): the processes this one shards parameters, gradients or
        optimizer states with, and the ones holding the same shard in the other sharding groups
        (None without hybrid sharding: one group of every process)."""
        if self.mesh is not None:
            return self.dims.groups()
        world = dist.group.WORLD
        assert world is not None, "no default process group"
        return world, None

    def make_precision(self) -> Precision:
        """The precision component: autocast on every prepared model, fp16's loss scaler."""
        return Precision(self.cfg.sharding.precision, self.info.device, self.cfg.sharding.loss_scale)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters are computed in (gathered in, where sharded)."""
        return self.precision.dtype

    @abstractmethod
    def setup_model(self, model: nn.Module, empty: EmptyModel | None = None) -> nn.Module:
        """Shard or replicate `model` on this process's device; return what the user calls.
        `empty`: the model was built on the meta device; allocate and initialize it (`fill`)."""

    def fill(self, model: nn.Module, empty: EmptyModel, device: torch.device | str) -> None:
        """Allocate an empty (meta) model on `device` as this strategy laid it out (shards
        only, where sharded), then initialize it module by module (`materialize`)."""
        allocate(model, device)
        materialize(model, empty.places, rng=empty.rng, skip=lambda name: name in empty.skip)

    def replicate(self, model: nn.Module, empty: EmptyModel | None) -> nn.Module:
        """A whole copy of `model` on this process's device, unwrapped: how a model prepared for
        inference only sits under ddp, zero1 and zero2 (`strategies.frozen`)."""
        if empty is not None:
            self.fill(model, empty, self.info.device)
        return model.to(self.info.device)

    def full_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """State-dict key -> full (unsharded) shape of the prepared model's tensors."""
        return full_shapes(self.unwrap(model))

    def load_weights(self, model: nn.Module, keys: Iterable[str], read: Reader) -> None:
        """Fill the model's tensors named `keys` (state-dict names) from `read`: each process
        reads what it holds (its rows of a sharded parameter)."""
        state = self.unwrap(model).state_dict(keep_vars=True)
        for key in keys:
            copy_into(state[key], key, read)

    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module (its parameter names are the ones the user created)."""

    def release(self) -> None:
        """Let go of what this strategy holds for its prepared models (`Engine.free_memory`):
        whatever Python's collector cannot free by dropping references."""
        return

    @abstractmethod
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Within this context, backward accumulates locally and communicates nothing."""

    @abstractmethod
    def make_runner(self, optimizer: torch.optim.Optimizer) -> OptimizerRunner:
        """The runner for an optimizer already bound to this strategy's parameters."""

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Unsharded weights as CPU tensors on the main process, `{}` elsewhere (collective)."""

    def rebind_state(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A full optimizer-state tensor of a parameter prepare replaced, in the form the new
        parameter needs (FSDP cuts it like its shard)."""
        return value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate an already scaled loss."""
        loss.backward(**kwargs)

    def optimizer_step(self, runner: OptimizerRunner, *, clip: float | None,
                       finite: bool | None) -> StepResult:
        """One optimizer step on an accumulation boundary (gradients already unscaled).

        `clip`: the bound to clip this runner's gradients to first (the config's max_grad_norm
        when the script did not clip), or None. `finite`: the fp16 overflow verdict, agreed by
        every rank (None without loss scaling); on an overflow the update is skipped.
        """
        if clip is not None:
            self.clip_grad_norm(runner.params(), clip, 2.0)
        self.precision.update(finite)
        if finite is False:
            return StepResult(applied=False)
        runner.step()
        return StepResult(applied=True)

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float,
                       norm_type: float) -> torch.Tensor:
        """Clip the gradients of `parameters` in place; return their global (unsharded) norm."""
        params = [p for p in parameters if p.grad is not None]
        meshes = {id(getattr(p, "device_mesh", None)) for p in params}
        if len(meshes) <= 1:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
            full = getattr(norm, "full_tensor", None)  # FSDP2: the norm of DTensor shards
            return full() if full is not None else norm
        return clip_over_meshes(params, max_norm, norm_type)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's weights keyed by parameter name, whole or as DTensor shards (for DCP)."""
        return get_model_state_dict(model)

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take back what `model_state` gave (filled in place by the checkpoint reader)."""
        set_model_state_dict(model, state)
