"""zero1, zero2 and zero3 on DeepSpeed (`backend="deepspeed"`).

The strategy and the prepared model are here; `setup` holds the one `import deepspeed`
and the config dict, `runner` the optimizer runner, and `internals` every
private DeepSpeed name, keyed by ZeRO stage.

The Engine's verbs keep their meaning; what DeepSpeed owns, and how it is kept in step:
  model      `prepare(model)` returns a `DeepSpeedModel`, the user's module behind a DeepSpeed
             engine that is built (`deepspeed.initialize`) when the module's optimizer is
             prepared, so an optimizer made before or after `prepare(model)` both work. A model
             with no optimizer gets an optimizer-less DeepSpeed engine at its first forward.
  optimizer  the user's own optimizer object, class and parameter groups: DeepSpeed's ZeRO
             optimizer wraps it and repoints its groups at the flat fp32 partitions this rank
             owns (1/W of every group). It is never swapped for DeepSpeedCPUAdam, offload or not.
  backward   plain `loss.backward()`: DeepSpeed's engine hooks the forward outputs and runs its
             reduce epilogue after autograd (torch-style backward), so one loss may span several
             models. The loss is divided by grad_accum_steps by the Engine, as on torch; DeepSpeed's
             own accumulation count is 1 so it never divides again. `num_items`' rescale at the
             boundary goes through DeepSpeed's loss scale for one step (`DeepSpeedRunner.scale_gradients`).
  accumulate off the boundary the DeepSpeed engine's `set_gradient_accumulation_boundary(False)`: stage 1
             keeps local gradients, stages 2-3 reduce-scatter into their partitions every
             micro-step (DeepSpeed has no no_sync for partitioned gradients); on the boundary
             it finalises the reduction and the optimizer step runs.
  clipping   the global L2 norm is computed from DeepSpeed's reduced gradient partitions when the
             script asks (so it is returned before the step), and DeepSpeed's step applies the
             clip with that bound, for that step only; `max_grad_norm` becomes DeepSpeed's
             `gradient_clipping`, the bound of every other step.
  precision  bf16 is DeepSpeed's `torch_autocast` with fp32 weights, fp32 reduction and fp32
             optimizer state, the torch backend's policy; fp16 is DeepSpeed's fp16 with its loss
             scaler (CUDA only: DeepSpeed's CPU accelerator has no fp16). `DeepSpeedPrecision`
             therefore adds no autocast and no scaler of ours.
  weights    `full_state_dict` gathers ZeRO-3 partitions one parameter at a time, no flag needed.
  eval       a ZeRO-3 forward under no_grad (evaluation, each `generate` step) ends with every
             parameter released to its partition: DeepSpeed's coordinator keeps what it gathered
             for a backward. `generate` runs synced (`fsdp.sync_generate`), the model's own methods
             pass through the prepared model (`generate`, `config`, ...), as on the torch backend.
  frozen     a model prepared for inference only (no trainable parameter: a DPO reference, a
             teacher) gets no DeepSpeed engine: DeepSpeed builds one around an optimizer step.
             It is sharded by our own FSDP2 under zero3 and replicated under zero1/zero2, as on
             the torch backend (`strategies.frozen`); its weights, checkpoints and exports go
             through that torch strategy.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...config.tree import EngineConfig, offload_spec
from ...distributed.world import DistInfo
from ...weights.adapters import unwrapped
from ...weights.loading import Reader
from ..base import EmptyModel, OptimizerRunner, StepResult, Strategy
from ..direct_calls import route_direct_calls
from ..frozen import for_inference
from ..fsdp import sync_generate
from ..host_step import step_on_host
from ..precision import Precision
from ..quantized import refuse_sharded_quantized
from . import internals as ds
from .runner import DeepSpeedRunner
from .setup import check_shard_group, deepspeed_config, import_deepspeed

__all__ = ["DeepSpeedModel", "DeepSpeedPrecision", "DeepSpeedRunner", "DeepSpeedStrategy",
           "deepspeed_config", "import_deepspeed"]


class DeepSpeedModel(nn.Module):
    """The user's module behind a DeepSpeed engine (built when its optimizer is prepared).

    Parameters, `train()`/`eval()` and state are the user's module's (`.module`); calling it
    runs DeepSpeed's forward, which gathers ZeRO-3 partitions and hooks the backward.
    """

    ds_engine: Any  # deepspeed.DeepSpeedEngine once built, else None
    _strategy: DeepSpeedStrategy

    def __init__(self, module: nn.Module, strategy: DeepSpeedStrategy) -> None:
        super().__init__()
        self.module = module
        # not submodules: the DeepSpeed engine holds `module` again, the strategy is no module at all
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "ds_engine", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.ds_engine
        if engine is None:  # evaluation-only model: a DeepSpeed engine without optimizer
            engine = self._strategy.initialize(self, None)
        return engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The user's module's own public methods and attributes (`generate`, `config`, ...)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "module" not in self._modules:
                raise
            return getattr(self._modules["module"], name)

    def release_gathered(self) -> None:
        """Every ZeRO-3 parameter back to its partition (the engine's call would also run gc)."""
        if self.ds_engine is not None:
            ds.release_gathered(self.ds_engine.optimizer, self._strategy.stage)


class DeepSpeedPrecision(Precision):
    """DeepSpeed casts (`torch_autocast`) and scales the loss (fp16) itself: nothing to add."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name, device)
        self.scaler = None  # DeepSpeed's own scaler; its verdict comes back from its step

    def apply_to(self, module: nn.Module) -> None:
        return


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _head_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The output head's own parameters (a transformers model's `get_output_embeddings()`)."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return list(head.parameters(recurse=False)) if isinstance(head, nn.Module) else []


def _nothing() -> None:
    return None


def _engine_forward(model: DeepSpeedModel, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A submodule's forward, called outside the model's: as part of a forward of the DeepSpeed
    engine when it can train (`internals.as_engine_forward`), else as it is. DeepSpeed
    gathers each module's ZeRO-3 partitions in that module's own hooks, so the call itself needs
    nothing more."""
    engine = model.ds_engine
    if engine is None or engine.optimizer is None or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return ds.as_engine_forward(engine, fn, *args, **kwargs)


class DeepSpeedStrategy(Strategy):
    """ZeRO stage 1, 2 or 3 with DeepSpeed's offload, one DeepSpeed engine per model."""

    supported_dims = frozenset({"dp_shard", "tp"})  # hybrid sharding: refused (MiCS is gone; see setup)
    # tensor parallelism on DeepSpeed is its AutoTP, which splits the Linear layers when the engine
    # is built (`initialize`; `tensor_parallel.autotp_size` in its config)
    own_steps = frozenset({"tp"})

    def __init__(self, cfg: EngineConfig, info: DistInfo, *, stage: int) -> None:
        deepspeed_config(cfg, device=info.device, numel=1)  # refuse a bad combination up front
        check_shard_group(cfg, info.world_size, info.local_world_size)  # ... and a hybrid group
        super().__init__(cfg, info, shards=True)
        self.stage = stage
        self.ds = import_deepspeed(info.device)
        self._owner: dict[int, DeepSpeedModel] = {}  # parameter id -> model
        self._torch: Strategy | None = None  # lays out the models prepared for inference only
        self._inference: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # ... which are these
        self._splits: dict[int, ds.TPSplit] = {}  # AutoTP (tensor_parallel_size): parameter id -> its split

    @property
    def frozen(self) -> Strategy:
        """The torch strategy of the same stage that holds models prepared for inference only."""
        if self._torch is None:
            from ..fsdp import FSDPStrategy

            # (an inference-only model: a replica below zero3, whatever the stage)
            self._torch = FSDPStrategy(self.cfg, self.info, stage=max(self.stage, 2))
        return self._torch

    def make_precision(self) -> Precision:
        return DeepSpeedPrecision(self.cfg.sharding.precision, self.info.device)

    # -- models -----------------------------------------------------------------------------
    def setup_model(self, model: nn.Module, empty: EmptyModel | None = None) -> nn.Module:
        if for_inference(model):  # no DeepSpeed engine: our FSDP2 shards it (zero3) or it is a replica
            out = self.frozen.setup_model(model, empty)
            self._inference.add(out)
            self.frozen.precision.apply_to(model)  # DeepSpeed's autocast lives in its engine: ours here
            return out
        if self.stage == 3:
            refuse_sharded_quantized(model, "zero3 (backend deepspeed)")
        if empty is not None:  # whole on each process until DeepSpeed partitions it (zero.Init is not used)
            self.fill(model, empty, "cpu")
        model.to(self.info.device)
        wrapped = DeepSpeedModel(model, self)
        unwrapped(model)  # a save_pretrained (reached through `wrapped` too) gathers on every process
        if self.stage == 3:  # a collective forward: generate runs synced, and ends on the partitions
            sync_generate(model, wrapped.release_gathered)
        # a submodule called on its own (get_encoder()(...)) runs as the engine's forward would
        route_direct_calls(model, [m for m in model.modules() if m is not model and _has_parameters(m)],
                           functools.partial(_engine_forward, wrapped),
                           wrapped.release_gathered if self.stage == 3 else _nothing)
        self._owner.update((id(p), wrapped) for p in model.parameters())
        return wrapped

    def initialize(self, model: DeepSpeedModel, optimizer: torch.optim.Optimizer | None) -> Any:
        """Build the DeepSpeed engine of `model` (ZeRO-3 partitions its parameters here)."""
        if model.ds_engine is not None:
            raise ValueError(
                "this model already ran under DeepSpeed without an optimizer; with "
                "backend='deepspeed', prepare the model's optimizer before its first forward"
            )
        numel = sum(p.numel() for p in model.module.parameters())
        config = deepspeed_config(self.cfg, device=self.info.device, numel=numel)
        engine, *_ = self.ds.initialize(
            model=model.module, optimizer=optimizer, config=config, dist_init_required=False
        )
        if optimizer is not None and not ds.supports_torch_style_backward(engine):
            raise RuntimeError(
                f"DeepSpeed {self.ds.__version__} cannot run loss.backward() directly with this "
                "torch; shardwise needs deepspeed>=0.18"
            )
        object.__setattr__(model, "ds_engine", engine)
        self._splits.update(ds.autotp_splits(model.module))
        self._owner.update((id(p), model) for p in model.module.parameters())  # (AutoTP's, if new)
        if self.stage == 3:
            # after DeepSpeed's own hooks: a no-grad forward has no backward to release for it
            engine.module.register_forward_hook(
                lambda *_: None if torch.is_grad_enabled() else model.release_gathered())
            # The output head, whole through the model's forward and backward (as FSDP2's root unit
            # holds it on the torch backend): TRL's fused LM head projects with `lm_head.weight`
            # itself, never calling the head. DeepSpeed registers such a read for the backward
            # only when it finds the weight partitioned; after a `generate` (which ran the head)
            # its prefetcher has gathered it, the read goes unregistered, and the backward meets
            # the partition (GRPO's first backward).
            for p in _head_parameters(model.module):
                self.ds.zero.register_external_parameter(model.module, p)
        return engine

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DeepSpeedModel) else model

    def release(self) -> None:
        # A DeepSpeed engine's hooks sit on the parameters' autograd nodes and hold the engine,
        # a cycle through C++ that the collector does not see; DeepSpeed's destroy() removes
        # the hooks it knows of (measured: stage 1/2 engines built by benchmarks/compare.py go).
        # ZeRO-3 also pushes the model on a module-level stack it never pops (DeepSpeed 0.19).
        for model in set(self._owner.values()):
            if model.ds_engine is not None:
                model.ds_engine.destroy()
                object.__setattr__(model, "ds_engine", None)
            ds.forget_module(model.module)
        self._owner.clear()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _off_boundary(getattr(model, "ds_engine", None))

    # -- optimizers -------------------------------------------------------------------------
    def make_runner(self, optimizer: torch.optim.Optimizer) -> OptimizerRunner:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        owners = {id(self._owner[id(p)]): self._owner[id(p)] for p in params if id(p) in self._owner}
        if len(owners) != 1:
            raise ValueError(
                f"under backend='deepspeed' each optimizer updates exactly one prepared model; "
                f"{type(optimizer).__name__} holds parameters of {len(owners)}: make one optimizer per model"
            )
        (model,) = owners.values()
        if model.ds_engine is not None and model.ds_engine.optimizer is not None:
            raise ValueError("this model already has an optimizer under DeepSpeed; prepare one optimizer "
                             "per model")
        names = {id(p): n for n, p in model.module.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self.initialize(model, optimizer)
        runner = DeepSpeedRunner(optimizer, model.module, model.ds_engine, group_names, stage=self.stage,
                                 whole=self._whole, part=self._part)
        # with offload (or on a CPU device) the user's optimizer steps DeepSpeed's fp32 partitions on the host
        runner.host_threads, kernel = step_on_host(
            optimizer, self.info.device, self.info.local_world_size,
            offloaded=offload_spec(self.cfg.sharding.offload).any, kernel=self.cfg.sharding.host_kernel)
        if kernel is not None:  # DeepSpeed's ZeRO optimizer steps the user's object through the kernel
            ds.step_through_kernel(model.ds_engine.optimizer, kernel)
        return runner

    def optimizer_step(self, runner: OptimizerRunner, *, clip: float | None,
                       finite: bool | None) -> StepResult:
        """DeepSpeed's step: it reduces (stage 1), clips to the bound in force (the script's, set
        by `clip_grad_norm` for this step only, else `gradient_clipping`, which is `clip`), checks
        fp16 overflow with its own scaler, and steps."""
        assert isinstance(runner, DeepSpeedRunner)
        try:
            runner.step()
            return StepResult(applied=bool(runner.ds_engine.was_step_applied()))
        finally:
            runner.end_step()  # a script's clip bound and num_items' rescale last one step

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.cfg.sharding.precision != "fp16":
            loss.backward(**kwargs)  # DeepSpeed's output hooks run its prologue and epilogue
            return
        trained = [m.ds_engine for m in set(self._owner.values())
                   if m.ds_engine is not None and m.ds_engine.optimizer is not None]
        if len(trained) != 1:
            raise ValueError(
                f"precision='fp16' on backend='deepspeed' scales the loss with one model's loss "
                f"scaler, and {len(trained)} models are being trained; use bf16, or backend='torch'"
            )
        trained[0].scale(loss).backward(**kwargs)

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float,
                       norm_type: float) -> torch.Tensor:
        """The global L2 norm of the gradients of the models these parameters belong to, from
        DeepSpeed's reduced partitions; DeepSpeed's next step clips to `max_norm` with it."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported by backend='deepspeed'; it clips the "
                             "L2 norm (2.0)")
        engines = {}
        for p in parameters:
            model = self._owner.get(id(p))
            if model is not None and model.ds_engine is not None and model.ds_engine.optimizer is not None:
                engines[id(model)] = model.ds_engine
        if not engines:
            raise ValueError("clip_grad_norm_ got no parameter of a model prepared with an optimizer")
        total = torch.zeros((), dtype=torch.float32)
        for engine in engines.values():
            opt = engine.optimizer
            norm = ds.scaled_global_norm(opt, self.stage) / ds.loss_scale(opt)
            total += norm.detach().float().cpu() ** 2
            ds.set_clip_bound(opt, max_norm)
        return total.sqrt().to(self.info.device)

    # -- weights ----------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole weights for an export: a trained parameter's fp32 master where DeepSpeed keeps
        the module's copy in another dtype (fp16: the weights it computes with are cast; an
        export of those would be fp16 and rounded), else the module's own; buffers as they are."""
        from deepspeed.utils import safe_get_full_fp32_param

        if model in self._inference:
            return self.frozen.full_state_dict(model)
        module = self.unwrap(model)
        engine = getattr(model, "ds_engine", None)
        gathered: dict[int, torch.Tensor] = {}
        for p in module.parameters():  # one parameter at a time: no rank holds the whole model twice
            master = (safe_get_full_fp32_param(p) if engine is not None and p.requires_grad
                      and p.dtype != torch.float32 else None)  # (a collective under ZeRO-3)
            with self.ds.zero.GatheredParameters([p], modifier_rank=None):
                # (AutoTP: every tp rank takes part)
                whole = self._whole(p, master if master is not None else p.detach())
                if self.info.is_main:
                    gathered[id(p)] = whole.to("cpu", copy=True)
        if not self.info.is_main:
            return {}
        out = {}
        for name, t in module.state_dict(keep_vars=True).items():
            out[name] = gathered[id(t)] if id(t) in gathered else t.detach().to("cpu", copy=True)
        return out

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole fp32 weights (from DeepSpeed's masters) and buffers, keyed by name (collective)."""
        from deepspeed.utils import safe_get_full_fp32_param

        if model in self._inference:
            return self.frozen.model_state(model)
        module = self.unwrap(model)
        out = {}
        for name, p in module.named_parameters():
            full = safe_get_full_fp32_param(p) if getattr(model, "ds_engine", None) is not None else None
            out[name] = self._whole(p, full if full is not None else p.detach()).clone()
        out.update({n: b.detach().clone() for n, b in _persistent_buffers(module).items()})
        return out

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if model in self._inference:
            self.frozen.load_model_state(model, state)
            return
        module = self.unwrap(model)
        for name, p in module.named_parameters():
            self._set_param(model, p, state[name])
        with torch.no_grad():
            for name, b in _persistent_buffers(module).items():
                b.copy_(state[name])

    def _set_param(self, model: nn.Module, p: torch.Tensor, full: torch.Tensor) -> None:
        """Give a parameter a whole new value: the optimizer's fp32 master (once DeepSpeed holds
        one) and the copy forward computes with (ZeRO-3: re-partitioned when the block exits)."""
        from deepspeed.utils import safe_set_full_fp32_param

        value = self._part(p, full).to(self.info.device, torch.float32)
        if getattr(model, "ds_engine", None) is not None:
            safe_set_full_fp32_param(p, value)
        with self.ds.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.data.copy_(value.to(p.dtype))

    def full_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """ZeRO-3 leaves its parameters empty in the module; `ds_shape` is their full shape."""
        if model in self._inference:
            return self.frozen.full_shapes(model)
        shapes = {}
        for k, v in self.unwrap(model).state_dict(keep_vars=True).items():
            split = self._splits.get(id(v))
            shapes[k] = split.whole_shape(ds.full_shape(v)) if split is not None else ds.full_shape(v)
        return shapes

    # -- AutoTP ------------------------------------------------------------------------------
    def _whole(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value` (a tensor laid out like parameter `p`) whole: AutoTP's parts gathered over the
        tp group (a collective of it), anything else as it is."""
        split = self._splits.get(id(p))
        return split.whole(value) if split is not None else value

    def _part(self, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of `whole` for parameter `p` (AutoTP's split; else all of it)."""
        split = self._splits.get(id(p))
        return split.part(whole) if split is not None else whole

    def load_weights(self, model: nn.Module, keys: Iterable[str], read: Reader) -> None:
        """Before DeepSpeed holds the model its tensors are plain; after, each parameter is set
        whole, one at a time (DeepSpeed scatters it to its partitions)."""
        if model in self._inference:
            self.frozen.load_weights(model, keys, read)
            return
        if getattr(model, "ds_engine", None) is None:
            super().load_weights(model, keys, read)
            return
        state = self.unwrap(model).state_dict(keep_vars=True)
        params = {id(p) for p in self.unwrap(model).parameters()}
        for key in keys:
            if id(state[key]) in params:
                self._set_param(model, state[key], read(key, None))
            else:
                with torch.no_grad():
                    state[key].copy_(read(key, None))


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers torch's `state_dict` holds (by name): the persistent ones only (a Llama's rotary
    `inv_freq` is not one), so a checkpoint moves between the backends."""
    params = {id(p) for p in module.parameters()}
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if id(t) not in params}


@contextlib.contextmanager
def _off_boundary(engine: Any) -> Iterator[None]:
    if engine is None or engine.optimizer is None:
        yield
        return
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(True)

