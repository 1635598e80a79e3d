"""zero1, zero2 and zero3 on DeepSpeed (`backend="deepspeed"`): the one file that imports it.

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
import logging
import math
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from ..adapters import unwrapped
from ..config import STRATEGY_TABLE, ConfigError, EngineConfig, check_strategy
from ..dist import DistInfo
from ..precision import Precision
from ..weights import Reader
from .base import EmptyModel, OptimizerRunner, StepResult, Strategy, zero_step
from .frozen import for_inference
from .fsdp import sync_generate
from .host_step import DeepSpeedAdam, step_on_host, threads

log = logging.getLogger("shardwise")
# Keys of a user's DeepSpeed JSON `zero_optimization` section that tune DeepSpeed itself and pass
# through untouched; the stage and the offload targets always come from our config.
_OURS = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"}


def import_deepspeed(device: torch.device) -> Any:
    """`import deepspeed`, or one clear error naming the install command."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the CPU accelerator, even beside GPUs
    try:
        import deepspeed
    except ImportError as err:
        raise ConfigError(
            f"backend='deepspeed' needs DeepSpeed, which is not importable here ({err}); install it "
            "with: pip install 'shardwise[deepspeed]'  (or choose backend='torch')"
        ) from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed 0.19 calls collectives torch 2.13 renamed; one warning per call is noise to users
    warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`", FutureWarning)
    return deepspeed


def deepspeed_config(cfg: EngineConfig, *, device: torch.device, numel: int) -> dict[str, Any]:
    """The DeepSpeed config dict for our config (pure: no deepspeed import).

    `numel` (the model's parameter count) caps the bucket sizes: DeepSpeed's defaults (5e8
    elements) allocate ~2 GB of fp32 buffers per rank whatever the model.
    """
    check_strategy(cfg.strategy, cfg.offload, "deepspeed")
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            "precision='fp16' with backend='deepspeed' needs CUDA: DeepSpeed's CPU accelerator has "
            "no fp16; use precision='bf16' (or backend='torch', whose fp16 runs on CPU)"
        )
    bucket = int(max(1, min(cfg.offload_bucket_numel, numel)))
    pin = device.type == "cuda"
    # tuning defaults: a DeepSpeed JSON's zero_optimization keys (`deepspeed_config`) win over these
    tuning: dict[str, Any] = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if cfg.strategy == "zero3":
        # zero3 means on DeepSpeed what it means on FSDP2: every parameter sharded (DeepSpeed
        # keeps ones under 1e5 elements whole), and a block's full parameters exist only while
        # it computes. DeepSpeed's default reuse distance (1e9 elements) keeps every parameter
        # used again within 1e9 elements gathered from forward to backward: on a model under
        # ~0.5B parameters, all of them (zero2's footprint, one all-gather per step instead of two)
        tuning |= {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                   "stage3_prefetch_bucket_size": bucket}
    zero: dict[str, Any] = {"stage": STRATEGY_TABLE[cfg.strategy].stage}
    if cfg.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if cfg.offload == "params":  # parameters on the host too (and the step there, as on torch)
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    zero = tuning | (_user_zero_keys(cfg.deepspeed_config) if cfg.deepspeed_config else {}) | zero
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the DataLoader sets the batch
        "gradient_accumulation_steps": 1,  # the Engine divides the loss by grad_accum_steps
        "gradient_clipping": float(cfg.max_grad_norm or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the user's torch optimizer, under ZeRO
        "zero_force_ds_cpu_optimizer": False,  # ... also under offload: never swapped
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.precision == "bf16":
        # fp32 weights and autocast compute; no module reduces in bf16 (an empty safe list)
        out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    elif cfg.precision == "fp16":
        ls = cfg.loss_scale
        out["fp16"] = {
            "enabled": True,
            "loss_scale": 0 if ls.dynamic else ls.init_scale,
            "initial_scale_power": round(math.log2(ls.init_scale)),
            "loss_scale_window": ls.growth_interval,
            "hysteresis": ls.hysteresis,
            "min_loss_scale": ls.min_scale,
        }
    return out


def _user_zero_keys(path: str) -> dict[str, Any]:
    """Tuning keys of a DeepSpeed JSON's zero_optimization section ("auto" ones left out)."""
    from ..config_io import read_file  # the same checks and one-line errors as every config file

    zero = read_file(path).get("zero_optimization") or {}
    return {k: v for k, v in zero.items() if k not in _OURS and v != "auto"}


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
        if self.ds_engine is not None and hasattr(self.ds_engine.optimizer, "empty_partition_cache"):
            self.ds_engine.optimizer.empty_partition_cache()


class DeepSpeedPrecision(Precision):
    """DeepSpeed casts (`torch_autocast`) and scales the loss (fp16) itself: nothing to add."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name, device)
        self.scaler = None  # DeepSpeed's own scaler; its verdict comes back from its step

    def apply_to(self, module: nn.Module) -> None:
        return


class _KernelStep:
    """The optimizer DeepSpeed's ZeRO optimizer steps under host_kernel="deepspeed": the user's
    own object, whose `step()` runs DeepSpeed's CPUAdam kernel over its groups and state. Every
    other attribute (param_groups, which DeepSpeed narrows to one group around each step, state,
    state_dict) reads and writes the user's object."""

    def __init__(self, optimizer: torch.optim.Optimizer, kernel: DeepSpeedAdam) -> None:
        object.__setattr__(self, "_user", optimizer)
        object.__setattr__(self, "_kernel", kernel)

    def step(self, closure: Any = None) -> None:
        self._kernel.step(self._user)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._user, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._user, name, value)


class DeepSpeedRunner(OptimizerRunner):
    """One prepared optimizer = one DeepSpeed engine's optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: DeepSpeedModel, names: list[list[str]]) -> None:
        self.optimizer = optimizer  # the user's; its groups now hold this rank's fp32 partitions
        self.model = model
        self.ds_engine = model.ds_engine
        self.group_names = names  # parameter names per group, as the user made them
        self.clip = float(self.ds_engine.optimizer.clip_grad)  # the config's bound (0: none)
        self._rescaled: tuple[float, float, float] | None = None  # loss scale kept, set, factor

    host_threads: int | None = None  # offload: the host step's threads

    def step(self) -> None:
        with threads(self.host_threads):
            self.ds_engine.step()  # on the boundary: reduce (stage 1), clip, step, zero the grads

    def params(self) -> list[torch.Tensor]:
        return list(self.model.module.parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ds_engine.optimizer.zero_grad(set_to_none=set_to_none)

    def scale_gradients(self, factor: float) -> None:
        """ZeRO-2/3 gradients live in DeepSpeed's partition buffers (on the host with offload),
        which no public call scales. What every ZeRO stage does read is its loss scale: its
        step divides the partitions by it (`unscale_and_clip_grads`), and its norm, clipping
        included, is taken of the gradients divided by it. So the factor goes there, for this
        step: the loss scale is divided by it here and restored after the step (`restore_scale`)."""
        opt = self.ds_engine.optimizer
        kept = float(opt.loss_scale)
        opt.loss_scale = kept / factor  # bf16/fp32: DeepSpeed's static scaler, 1.0 otherwise
        self._rescaled = (kept, float(opt.loss_scale), factor)

    def restore_scale(self) -> None:
        """The loss scale as before `scale_gradients`; fp16's dynamic scaler keeps its own verdict
        on this step (a halving or growth is multiplied back by the same factor)."""
        if self._rescaled is None:
            return
        (kept, scaled, factor), self._rescaled = self._rescaled, None
        opt = self.ds_engine.optimizer
        now = float(opt.loss_scale)
        opt.loss_scale = kept if now == scaled else now * factor


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
        """This rank's fp32 partitions and the user's group each belongs to. Stage 3 lends them
        to the optimizer's groups only while it steps, so its groups are empty at rest."""
        opt = self.ds_engine.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # stage 3: one per sub-group
            flats = opt.fp32_partitioned_groups_flat
            return [(f, opt.sub_group_to_group_id[i]) for i, f in enumerate(flats)]
        return [(f, i) for i, f in enumerate(opt.single_partition_of_fp32_groups)]

    def _ensure_state(self) -> None:
        """Give a fresh optimizer its state (`zero_step` over this rank's partitions) and point
        DeepSpeed's per-parameter views at it (stages 1-2 link them after the first step)."""
        flats = self._flat_partitions()
        if not any(f in self.optimizer.state for f, _ in flats):
            per_group: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
            for f, gi in flats:
                per_group[gi].append(f)
            zero_step(self.optimizer, per_group)  # offload's host gradient buffers stay attached
        opt = self.ds_engine.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):  # stages 1 and 2
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        """torch's `get_optimizer_state_dict` layout with whole tensors, so a checkpoint moves
        between backends, stages and world sizes (each is gathered: a collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self._ensure_state()
        params = dict(self.model.module.named_parameters())
        step = self._step()
        state: dict[str, Any] = {}
        groups = []
        for names, group in zip(self.group_names, self.optimizer.param_groups):
            for name in names:
                entry = {k: safe_get_full_optimizer_state(params[name], k) for k in _state_keys(self.optimizer)}
                if step is not None and all(torch.is_tensor(v) for v in entry.values()):
                    state[name] = {"step": step.clone(), **{k: v.detach().cpu() for k, v in entry.items()}}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})
        return {"state": state, "param_groups": groups}

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        self._ensure_state()
        params = dict(self.model.module.named_parameters())
        for name, entry in state["state"].items():
            for key, value in entry.items():
                if key != "step":
                    safe_set_full_optimizer_state(params[name], value.to(torch.float32), key)
        steps = [e["step"] for e in state["state"].values() if "step" in e]
        for st in self.optimizer.state.values():
            if "step" in st and steps:
                st["step"].copy_(steps[0]) if torch.is_tensor(st["step"]) else st.__setitem__("step", steps[0])
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


class DeepSpeedStrategy(Strategy):
    """ZeRO stage 1, 2 or 3 with DeepSpeed's offload, one DeepSpeed engine per model."""

    def __init__(self, cfg: EngineConfig, info: DistInfo, *, stage: int) -> None:
        deepspeed_config(cfg, device=info.device, numel=1)  # refuse a bad combination up front
        super().__init__(cfg, info)
        self.stage = stage
        self.ds = import_deepspeed(info.device)
        self._owner: dict[int, DeepSpeedModel] = {}  # parameter id -> model
        self._torch: Strategy | None = None  # lays out the models prepared for inference only
        self._inference: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # ... which are these

    @property
    def frozen(self) -> Strategy:
        """The torch strategy of the same stage that holds models prepared for inference only."""
        if self._torch is None:
            from .fsdp import FSDPStrategy

            self._torch = FSDPStrategy(self.cfg, self.info, stage=self.stage)
        return self._torch

    def make_precision(self) -> Precision:
        return DeepSpeedPrecision(self.cfg.precision, self.info.device)

    # -- models -----------------------------------------------------------------------------
    def setup_model(self, model: nn.Module, empty: EmptyModel | None = None) -> nn.Module:
        if for_inference(model):  # no DeepSpeed engine: our FSDP2 shards it (zero3) or it is a replica
            out = self.frozen.setup_model(model, empty)
            self._inference.add(out)
            self.frozen.precision.apply_to(model)  # DeepSpeed's autocast lives in its engine: ours here
            return out
        if empty is not None:  # whole on each process until DeepSpeed partitions it (zero.Init is not used)
            self.fill(model, empty, "cpu")
        model.to(self.info.device)
        wrapped = DeepSpeedModel(model, self)
        unwrapped(model)  # a main-process save_pretrained (reached through `wrapped` too) is refused
        if self.stage == 3:  # a collective forward: generate runs synced, and ends on the partitions
            sync_generate(model, wrapped.release_gathered)
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
        if optimizer is not None and not engine._support_torch_style_backward:
            raise RuntimeError(
                f"DeepSpeed {self.ds.__version__} cannot run loss.backward() directly with this "
                "torch; shardwise needs deepspeed>=0.18"
            )
        object.__setattr__(model, "ds_engine", engine)
        if self.stage == 3:  # after DeepSpeed's own hooks: a no-grad forward has no backward to release for it
            engine.module.register_forward_hook(lambda *_: None if torch.is_grad_enabled() else model.release_gathered())
        return engine

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DeepSpeedModel) else model

    def release(self) -> None:
        # A DeepSpeed engine's hooks sit on the parameters' autograd nodes and hold the engine,
        # a cycle through C++ that the collector does not see; DeepSpeed's destroy() removes
        # the hooks it knows of (measured: stage 1/2 engines built by benchmarks/compare.py go).
        # ZeRO-3 also pushes the model on a module-level stack it never pops (DeepSpeed 0.19).
        from deepspeed.runtime.zero import parameter_offload

        stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
        for model in set(self._owner.values()):
            if model.ds_engine is not None:
                model.ds_engine.destroy()
                object.__setattr__(model, "ds_engine", None)
            if isinstance(stack, list):
                stack[:] = [m for m in stack if m is not model.module]
        self._owner.clear()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _off_boundary(getattr(model, "ds_engine", None))

    # -- optimizers -------------------------------------------------------------------------
    def make_runner(self, optimizer: torch.optim.Optimizer) -> OptimizerRunner:
        owners = {id(self._owner[id(p)]): self._owner[id(p)] for g in optimizer.param_groups for p in g["params"]
                  if id(p) in self._owner}
        if len(owners) != 1:
            raise ValueError(
                f"under backend='deepspeed' each optimizer updates exactly one prepared model; "
                f"{type(optimizer).__name__} holds parameters of {len(owners)}: make one optimizer per model"
            )
        (model,) = owners.values()
        if model.ds_engine is not None and model.ds_engine.optimizer is not None:
            raise ValueError("this model already has an optimizer under DeepSpeed; prepare one optimizer per model")
        names = {id(p): n for n, p in model.module.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self.initialize(model, optimizer)
        runner = DeepSpeedRunner(optimizer, model, group_names)
        # with offload (or on a CPU device) the user's optimizer steps DeepSpeed's fp32 partitions on the host
        runner.host_threads, kernel = step_on_host(optimizer, self.info.device, self.info.local_world_size,
                                                   offloaded=self.cfg.offload != "none", kernel=self.cfg.host_kernel)
        if kernel is not None:  # DeepSpeed's ZeRO optimizer steps the user's object through the kernel
            zero = model.ds_engine.optimizer
            zero.optimizer = _KernelStep(zero.optimizer, kernel)
        return runner

    def optimizer_step(self, runner: OptimizerRunner, *, clip: float | None, finite: bool | None) -> StepResult:
        """DeepSpeed's step: it reduces (stage 1), clips to the bound in force (the script's, set
        by `clip_grad_norm` for this step only, else `gradient_clipping`, which is `clip`), checks
        fp16 overflow with its own scaler, and steps."""
        assert isinstance(runner, DeepSpeedRunner)
        try:
            runner.step()
            return StepResult(applied=bool(runner.ds_engine.was_step_applied()))
        finally:
            runner.ds_engine.optimizer.clip_grad = runner.clip  # a script's bound lasts one step
            runner.restore_scale()  # num_items' rescale lasts one step too

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.cfg.precision != "fp16":
            loss.backward(**kwargs)  # DeepSpeed's output hooks run its prologue and epilogue
            return
        trained = [m.ds_engine for m in set(self._owner.values()) if m.ds_engine is not None and m.ds_engine.optimizer is not None]
        if len(trained) != 1:
            raise ValueError(
                f"precision='fp16' on backend='deepspeed' scales the loss with one model's loss "
                f"scaler, and {len(trained)} models are being trained; use bf16, or backend='torch'"
            )
        trained[0].scale(loss).backward(**kwargs)

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """The global L2 norm of the gradients of the models these parameters belong to, from
        DeepSpeed's reduced partitions; DeepSpeed's next step clips to `max_norm` with it."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported by backend='deepspeed'; it clips the L2 norm (2.0)")
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
            norm = _scaled_global_norm(opt) / float(opt.loss_scale)
            total += norm.detach().float().cpu() ** 2
            opt.clip_grad = float(max_norm)
        return total.sqrt().to(self.info.device)

    # -- weights ----------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if model in self._inference:
            return self.frozen.full_state_dict(model)
        module = self.unwrap(model)
        gathered: dict[int, torch.Tensor] = {}
        for p in module.parameters():  # one parameter at a time: no rank holds the whole model twice
            with self.ds.zero.GatheredParameters([p], modifier_rank=None):
                if self.info.is_main:
                    gathered[id(p)] = p.detach().to("cpu", copy=True)
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
            out[name] = (full if full is not None else p.detach()).clone()
        out.update({n: b.detach().clone() for n, b in module.named_buffers()})
        return out

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if model in self._inference:
            self.frozen.load_model_state(model, state)
            return
        module = self.unwrap(model)
        for name, p in module.named_parameters():
            self._set_param(model, p, state[name])
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(state[name])

    def _set_param(self, model: nn.Module, p: torch.Tensor, full: torch.Tensor) -> None:
        """Give a parameter a whole new value: the optimizer's fp32 master (once DeepSpeed holds
        one) and the copy forward computes with (ZeRO-3: re-partitioned when the block exits)."""
        from deepspeed.utils import safe_set_full_fp32_param

        value = full.to(self.info.device, torch.float32)
        if getattr(model, "ds_engine", None) is not None:
            safe_set_full_fp32_param(p, value)
        with self.ds.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.data.copy_(value.to(p.dtype))

    def full_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """ZeRO-3 leaves its parameters empty in the module; `ds_shape` is their full shape."""
        if model in self._inference:
            return self.frozen.full_shapes(model)
        return {k: tuple(getattr(v, "ds_shape", v.shape)) for k, v in self.unwrap(model).state_dict(keep_vars=True).items()}

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


def _scaled_global_norm(opt: Any) -> torch.Tensor:
    """The loss-scaled global gradient norm DeepSpeed's own step computes (all ranks agree)."""
    if hasattr(opt, "scaled_global_norm"):  # stages 1 and 2
        return cast(torch.Tensor, opt.scaled_global_norm())
    from deepspeed.runtime.utils import combine_grad_norm_groups  # stage 3

    return cast(torch.Tensor, combine_grad_norm_groups(opt._get_norm_groups()))


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

