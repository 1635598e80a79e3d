"""`Session`: the prepare pipeline and the training step, below the user's `Engine`.

A session holds one strategy (with its precision), the models, optimizers and schedulers
prepared on it, and the `StepState` they share. `prepare` checks everything first, then shards
or wraps the models, rebinds optimizers made before `prepare` to the prepared parameters (by
name: class, groups and state kept), builds each optimizer's runner, and wraps schedulers.
`Engine` adds the process group, DataLoaders, collectives and checkpoints on top; the planner
drives a session directly on fake ranks. The step protocol is written down in `shardwise.engine.step`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.tree import BlocksConfig
from ..distributed.internals import is_fake
from ..distributed.world import host_device
from ..strategies import Strategy
from ..strategies.base import EmptyModel
from ..strategies.steps import parallelize
from ..weights.loading import make_reader, verify_shared
from ..weights.materialize import empty_places, is_empty
from .optim import PreparedOptimizer, PreparedScheduler, rebind_optimizer
from .step import StepState

log = logging.getLogger("shardwise")
# on a model from `Engine.from_pretrained`: a `weights.loading.Pretrained`
PRETRAINED = "_shardwise_pretrained"


def check_optimizer(optimizer: torch.optim.Optimizer, models: Sequence[nn.Module],
                    prepared: set[int]) -> None:
    """An optimizer may update only parameters of `models` (prepared with it) or of models
    already prepared (`prepared`: their parameter ids)."""
    pending = {id(p) for m in models for p in m.parameters()} | prepared
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in pending]
    if stray:
        shapes = ", ".join(str(tuple(p.shape)) for p in stray[:3])
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(stray)} parameter(s) of no prepared model "
            f"(shapes {shapes}{', ...' if len(stray) > 3 else ''}); pass the model to "
            "prepare() in the same call as the optimizer, or before it"
        )


class Session:
    """One strategy, what was prepared on it, and the step they share."""

    def __init__(self, blocks: BlocksConfig, strategy: Strategy, *, grad_accum_steps: int,
                 max_grad_norm: float | None) -> None:
        self.blocks = blocks  # what is done to each block before sharding
        self.max_grad_norm = max_grad_norm
        self.strategy = strategy
        self.step_state = StepState(grad_accum_steps)
        self.models: list[nn.Module] = []
        self.optimizers: list[PreparedOptimizer] = []
        self.schedulers: list[PreparedScheduler] = []
        self.param_ids: set[int] = set()  # parameters of the prepared models
        self.init_rng: torch.Tensor | None = None  # `init_empty()`: the generator state it began with

    def release(self) -> None:
        """Drop everything prepared on this session (`Engine.free_memory`)."""
        self.strategy.release()
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.param_ids.clear()

    @property
    def grad_accum_steps(self) -> int:
        """Micro-steps per optimizer step: the loss divisor and the boundary (`StepState` holds it)."""
        return self.step_state.grad_accum_steps

    def set_grad_accum(self, steps: int) -> None:
        """Change the micro-steps per optimizer step (`Engine.set_grad_accum` calls this; the step
        state is its one holder)."""
        self.step_state.grad_accum_steps = steps

    # -- prepare ----------------------------------------------------------------------------
    def is_prepared_model(self, module: nn.Module) -> bool:
        return any(module is m or module is self.strategy.unwrap(m) for m in self.models)

    def prepare(
        self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
    ) -> dict[int, Any]:
        """Prepare models, then optimizers (rebound to the prepared parameters), then schedulers;
        `id(object) -> prepared object`. The caller checked them first (`check_optimizer`)."""
        names: dict[int, tuple[int, str]] = {}  # parameter -> (model, name), to rebind optimizers
        for k, m in enumerate(models):
            for name, p in m.named_parameters():
                names[id(p)] = (len(self.models) + k, name)
        prepared: dict[int, Any] = {}
        strategy = self.strategy
        for model in models:  # the steps, in `strategies.steps`' order; the data-parallel one last
            if not is_empty(model):
                self._agree_weights(model)  # every process starts from process 0's weights
            parallelize(model, strategy.dims, strategy.cfg.parallelism, self.blocks,
                        own_steps=strategy.own_steps)
            prepared[id(model)] = self._prepare_model(model)
        new_params = [dict(self.strategy.unwrap(m).named_parameters()) for m in self.models]

        def new_param(p: torch.Tensor) -> torch.Tensor:
            if id(p) in names:
                model_idx, name = names[id(p)]
                return new_params[model_idx][name]
            return p  # already a prepared parameter (optimizer made after prepare(model))

        for optimizer in optimizers:
            rebind_optimizer(optimizer, new_param, self.strategy.rebind_state)
            prepared[id(optimizer)] = self.add_optimizer(optimizer)
        for scheduler in schedulers:
            prepared[id(scheduler)] = self.add_scheduler(scheduler)
        return prepared

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        pending = getattr(model, PRETRAINED, None)
        source, found = pending.check(model) if pending is not None else (None, {})
        empty = None
        if is_empty(model):  # built on the meta device: the strategy allocates it as it lays it out
            empty = EmptyModel(empty_places(model), self._agreed_rng(), frozenset(found))
        wrapped = self.strategy.setup_model(model, empty)
        self.strategy.precision.apply_to(self.strategy.unwrap(wrapped))  # low-dtype compute, fp32 weights
        self.models.append(wrapped)
        self.param_ids.update(id(p) for p in wrapped.parameters())
        if source is not None:
            self.load_weights(wrapped, source, found)
        return wrapped

    @torch.no_grad()
    def _agree_weights(self, model: nn.Module) -> None:
        """Every process starts from process 0's weights and buffers (as DDP does), one
        broadcast per tensor before sharding: a model built on unseeded processes would
        otherwise be sharded from different initializations."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        host = host_device(self.strategy.info.device)  # the CPU, or the device on a pure-NCCL group
        via = host if host.type != "cpu" else None
        tensors = [t for t in [*model.parameters(), *model.buffers()] if not t.is_meta]
        if tensors and is_fake(tensors[0]):
            return  # the planner's fake-tensor trace: nothing to agree on
        # a fingerprint first (two float64 sums, one all-gather): processes that built the same
        # weights, the usual seeded case, skip the broadcast of the whole model
        weighted, squares = 0.0, 0.0
        for i, t in enumerate(tensors):
            for chunk in t.detach().reshape(-1).split(2**22):  # float64 copies of 32 MiB at most
                d = chunk.double()
                weighted += float(d.sum()) * (i + 1)
                squares += float((d * d).sum())
        mine = torch.tensor([weighted, squares], dtype=torch.float64)
        rows = [torch.zeros_like(mine, device=via) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine.to(via) if via is not None else mine)
        if all(torch.equal(r, rows[0]) for r in rows):
            return
        for t in tensors:
            buf = t.data
            if via is not None or not buf.is_contiguous():
                buf = buf.to(via if via is not None else buf.device).contiguous()
            dist.broadcast(buf, src=0)
            if buf is not t.data:
                t.data.copy_(buf)

    def _agreed_rng(self) -> torch.Tensor:
        """The generator state an empty model's initializers start from, rank 0's on every
        process (one small broadcast), so every process draws the same full values."""
        rng = (self.init_rng if self.init_rng is not None else torch.get_rng_state()).clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            sent = rng.to(host_device(self.strategy.info.device))  # (a pure-NCCL group: on the device)
            dist.broadcast(sent, src=0)
            rng = sent.cpu()
        return rng

    def load_weights(self, model: nn.Module, source: Path, found: dict[str, Any]) -> None:
        """Pretrained weights into a prepared model (checked by `check_source` already)."""
        info = self.strategy.info
        verify_shared(source, info.rank, info.world_size)
        self.strategy.load_weights(model, found, make_reader(found))
        owned = {id(p) for p in model.parameters()}
        for o in self.optimizers:
            if any(id(p) in owned for p in o.runner.owner_params()):
                o.runner.reload_params()

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """An optimizer already bound to prepared parameters, with its runner."""
        prepared = PreparedOptimizer(optimizer, self.strategy.make_runner(optimizer), strategy=self.strategy,
                                     state=self.step_state, max_grad_norm=self.max_grad_norm)
        self.optimizers.append(prepared)
        return prepared

    def add_scheduler(self, scheduler: Any) -> PreparedScheduler:
        target = scheduler.optimizer
        owners = [o for o in self.optimizers if target is o or target is o.optimizer]
        if not owners:
            raise ValueError(
                f"{type(scheduler).__name__}'s optimizer was not prepared; pass the optimizer to "
                "prepare() in the same call as the scheduler, or before it"
            )
        prepared = PreparedScheduler(scheduler, owners, self.step_state)
        self.schedulers.append(prepared)
        return prepared

    # -- the step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, models: Sequence[nn.Module], *, loader_at_end: bool,
                   sync_each_batch: bool = False) -> Iterator[None]:
        """One micro-step; off the accumulation boundary `models` communicate nothing, unless
        `sync_each_batch` (every backward communicates; the optimizers still step at the boundary)."""
        self.step_state.begin_micro_step(loader_at_end)
        with contextlib.ExitStack() as stack:
            if not self.step_state.sync and not sync_each_batch:
                for m in models or self.models:
                    stack.enter_context(self.strategy.no_sync(m))
            yield

    def backward(self, loss: torch.Tensor, *, num_items: Any = None, **kwargs: Any) -> None:
        """Divide by grad_accum_steps, scale (fp16), backpropagate through the strategy.
        `num_items`: `loss` is a sum over that many items; the boundary rescales the gradients
        to the mean over every process's items of the step (`shardwise.engine.items`)."""
        self.step_state.items.add(num_items)
        loss = self.strategy.precision.scale_loss(loss / self.step_state.grad_accum_steps)
        self.strategy.backward(loss, **kwargs)

    def unscale_gradients(self) -> None:
        for o in self.optimizers:
            o.unscale_gradients()

    def clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float) -> torch.Tensor | None:
        """Clip on the accumulation boundary; the global norm (None off the boundary)."""
        if not self.step_state.sync:
            return None
        self.step_state.clipped = True
        self.unscale_gradients()
        return self.strategy.clip_grad_norm(parameters, max_norm, norm_type)
