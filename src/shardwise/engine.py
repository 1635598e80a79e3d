"""`Engine`: an ordinary PyTorch loop, sharded. The verbs follow Hugging Face Accelerate.

The engine resolves the config, joins the process group, prepares DataLoaders, and offers the
collectives and checkpoints; models, optimizers, schedulers and the step are its `Session`'s
(`shardwise.session`), and everything that depends on the strategy is the `Strategy`'s.

Words: "Engine" is this user object only. "backend" is the library under the strategies (torch
or DeepSpeed). A "DeepSpeed engine" (`ds_engine`) is DeepSpeed's own `DeepSpeedEngine`, one per
model on that backend. The "loop state" is what a checkpoint keeps besides tensors: step
counters, loss scaler, schedulers, DataLoader positions, registered objects (`engine.pt`, the
file name of checkpoint format 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .adapters import save_problem, save_weights, unwrapped
from .collectives import check_reduction, gather_one, map_tensors, reduce_one
from .config import ConfigError, EngineConfig, make_config, resolve_grad_accum
from .config_io import config_with_code
from .data import PreparedDataLoader, is_dataloader
from .dist import config_source, init_distributed
from .items import per_item
from .materialize import init_empty
from .memory import MemoryReport, tensor_memory
from .observe import Observer, TrackerVerbs
from .optim import PreparedOptimizer, PreparedScheduler, build_optimizer, build_scheduler
from .precision import check_device_supports
from .resilience import Guard, say
from .session import PRETRAINED, Session, check_optimizer
from .storage import CheckpointError, agree, os_error_line
from .strategies import make_strategy
from .strategies.frozen import check_inference_models, for_inference
from .trackers import check_log_with
from .weights import Pretrained, check_source

log = logging.getLogger("shardwise")

_ACCELERATE_PRECISION = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _is_scheduler(obj: object) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
    )


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (every device) on this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Engine(TrackerVerbs):
    """Runs a PyTorch training loop under ddp, zero1, zero2 or zero3 on one or many processes.

    Keywords fill an `EngineConfig` (see its fields for the meaning of each); Accelerate's
    `mixed_precision` ("no", "fp16", "bf16") and `gradient_accumulation_steps` are accepted too.
    Under `shardwise launch` (or with SHARDWISE_CONFIG / `--config FILE`) the resolved config file
    comes first and keywords given in code override it, with one warning naming both values.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if "mixed_precision" in kwargs:
            mp = kwargs.pop("mixed_precision")
            if mp not in _ACCELERATE_PRECISION:
                raise ConfigError(f"mixed_precision={mp!r} is not valid; choose one of: no, bf16, fp16")
            kwargs.setdefault("precision", _ACCELERATE_PRECISION[mp])
        if "gradient_accumulation_steps" in kwargs:
            kwargs.setdefault("grad_accum_steps", kwargs.pop("gradient_accumulation_steps"))
        if "log_with" in kwargs:  # a name, a list of names or Accelerate's LoggerType members
            kwargs["log_with"] = check_log_with(kwargs["log_with"])
        if config is not None and kwargs:
            raise ConfigError("pass either config= or keywords to Engine(), not both")
        conflicts: list[str] = []
        if config is None:
            # the keywords alone first: a bad value is named as the code wrote it
            make_config(**{k: v for k, v in kwargs.items() if k not in ("launch", "loss_scale")})
            config, conflicts = config_with_code(kwargs, config_source())
        self.config = cfg = config
        self._info = init_distributed(force_cpu=cfg.cpu, timeout_s=cfg.collective_timeout_s)
        if conflicts and self._info.is_main:
            warnings.warn("code overrides the config file: " + "; ".join(conflicts), stacklevel=2)
        check_device_supports(cfg.precision, self._info.device)
        # strategy="auto" is chosen at the first prepare, from the model and its batch
        self._session: Session | None = None
        if cfg.strategy != "auto":
            self._session = Session(cfg, make_strategy(cfg, self._info))
        self.plan: Any = None  # strategy="auto": the plan the choice came from
        if cfg.seed is not None:  # only a seed the user gave: a script's own set_seed() stands
            set_seed(cfg.seed)
        self._loader: PreparedDataLoader | None = None  # the loader that yielded the last batch
        self._loader_at_end = False
        self._loaders: list[PreparedDataLoader] = []
        self._registered: list[Any] = []
        self._init_rng: torch.Tensor | None = None  # init_empty(): the generator state it began with
        self._last_save: Any = None  # the newest save's SaveReport
        self.optimizer: PreparedOptimizer | None = None  # built from config.optimizer, if any
        self.scheduler: PreparedScheduler | None = None  # built from config.scheduler, if any
        self._guard = Guard(cfg, self._info)  # checkpoints by policy, preemption, timeouts
        self._observer = Observer(cfg, self._info)  # metrics, trackers, progress
        self._pass: tuple[int, int] | None = None  # the training loader's pass the progress bar shows
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restarts:
            say(self._info, f"the worker group was restarted ({restarts} restart(s) so far)")

    @property
    def session(self) -> Session:
        """The strategy and what was prepared on it (strategy='auto': from the first prepare)."""
        if self._session is None:
            raise RuntimeError(
                "strategy='auto' chooses the strategy at the first prepare(); prepare the model "
                "(and its DataLoader) before this call"
            )
        return self._session

    # -- where this process sits ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._info.device

    @property
    def process_index(self) -> int:
        return self._info.rank

    @property
    def local_process_index(self) -> int:
        return self._info.local_rank

    @property
    def num_processes(self) -> int:
        return self._info.world_size

    @property
    def is_main_process(self) -> bool:
        return self._info.is_main

    @property
    def is_local_main_process(self) -> bool:
        return self._info.is_local_main

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step that ends an accumulation (gradients are communicated)."""
        return self._session is None or self._session.step_state.sync

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self._session is not None and any(o.step_was_skipped for o in self._session.optimizers)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 when nothing is scaled, or DeepSpeed scales)."""
        return self._session.strategy.precision.loss_scale if self._session is not None else 1.0

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self._guard.heartbeat("waiting for everyone")  # moved on, for a call the main process makes alone
        dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Shard models, rebind optimizers, split DataLoaders, wrap schedulers.

        Any order and number; the results come back in the same order (one object: itself).
        Everything is checked before anything is changed.
        """
        kinds = [self._kind(obj) for obj in objects]
        of = {kind: [o for o, k in zip(objects, kinds) if k == kind] for kind in ("model", "optimizer", "scheduler", "dataloader")}
        for loader in of["dataloader"]:
            self._check_batch_sizes(loader)
        known = self._session.param_ids if self._session is not None else set()
        check_inference_models([*of["model"], *(self._session.models if self._session else [])], of["optimizer"])
        for optimizer in of["optimizer"]:
            check_optimizer(optimizer, of["model"], known)
        if self._session is None:
            from .auto import choose

            self.config, self.plan = choose(self.config, self._info, of["model"], of["dataloader"])
            self._session = Session(self.config, make_strategy(self.config, self._info))
        session = self._session
        session.init_rng = self._init_rng
        for model in of["model"]:
            self._observer.watch(model)
        prepared = session.prepare(of["model"], of["optimizer"], of["scheduler"])
        for model in of["model"]:  # the heartbeat that says who did not arrive if a collective hangs
            prepared[id(model)].register_forward_pre_hook(self._forward_started, prepend=True)
        for loader in of["dataloader"]:
            prepared[id(loader)] = PreparedDataLoader(
                loader,
                world=self.num_processes,
                rank=self.process_index,
                device=self.device,
                on_batch=self._on_batch,
                **{"seed": self.config.seed, **self._loader_options()},
            )
            self._loaders.append(prepared[id(loader)])
        trained = [m for m in of["model"] if not for_inference(m)]  # a frozen reference gets no optimizer
        if trained and not of["optimizer"] and not session.optimizers and self.config.optimizer:
            loaders = [prepared[id(o)] for o in of["dataloader"]]
            self._build_from_config(prepared[id(trained[0])], loaders[0] if loaders else None)
        out = tuple(prepared[id(o)] for o in objects)
        return out[0] if len(out) == 1 else out

    def _loader_options(self) -> dict[str, Any]:
        """How prepared DataLoaders end an epoch (`shardwise.data`); `Accelerator` follows Accelerate."""
        return {}

    def _build_from_config(self, model: nn.Module, loader: PreparedDataLoader | None) -> None:
        """The optimizer (and schedule) the config describes, for a script that passes none;
        they are `engine.optimizer` and `engine.scheduler`."""
        assert self.config.optimizer is not None
        raw = build_optimizer(self.config.optimizer, model)
        self.optimizer = self.session.add_optimizer(raw)
        log.info("built %s from the config", type(raw).__name__)
        if self.config.scheduler is not None:
            steps = len(loader) // self.config.grad_accum_steps if loader is not None else None
            self.scheduler = self.session.add_scheduler(build_scheduler(self.config.scheduler, raw, steps))

    def _check_batch_sizes(self, loader: Any) -> None:
        micro = self.config.micro_batch_size
        if isinstance(micro, int) and micro != loader.batch_size and self.is_main_process:
            warnings.warn(
                f"the DataLoader in code has batch_size={loader.batch_size}, the config says "
                f"micro_batch_size={micro}; the code's value is used",
                stacklevel=3,
            )
        if loader.batch_size is not None:
            accum = resolve_grad_accum(self.config, loader.batch_size, self.num_processes)
            if accum != self.config.grad_accum_steps:
                say(self._info, f"train_batch_size={self.config.train_batch_size} at {self.num_processes} process(es) "
                    f"x batch {loader.batch_size}: grad_accum_steps {self.config.grad_accum_steps} -> {accum}")
                self.config = dataclasses.replace(self.config, grad_accum_steps=accum)
                if self._session is not None:
                    self._session.set_config(self.config)

    def _kind(self, obj: Any) -> str:
        if isinstance(obj, nn.Module):
            if self._session is not None and self._session.is_prepared_model(obj):
                raise ValueError(f"{type(obj).__name__} was already prepared; prepare each model once")
            return "model"
        if isinstance(obj, PreparedOptimizer):
            raise ValueError("this optimizer was already prepared; prepare each optimizer once")  # noqa: TRY004
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if is_dataloader(obj):
            return "dataloader"
        if _is_scheduler(obj):
            return "scheduler"
        raise TypeError(
            f"prepare() cannot handle {type(obj).__module__}.{type(obj).__qualname__}; it takes "
            "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader and LR schedulers"
        )

    # -- the step ---------------------------------------------------------------------------
    def _on_batch(self, loader: PreparedDataLoader, last: bool, batch: Any) -> None:
        self._boundary()  # before the batch counts as served: a checkpoint here resumes with it
        self._loader, self._loader_at_end = loader, last
        self._observer.on_batch(batch)

    def _boundary(self) -> None:
        """Once per optimizer step, before the next one's work: heartbeat, agreement on
        preemption, checkpoints by policy (`shardwise.resilience`). Every process gets here."""
        if self._session is not None and self._session.models:
            self._observer.at_boundary(self.step, self._probe)
            self._guard.at_boundary(self.step, self._policy_save)

    def _probe(self) -> tuple[MemoryReport | None, dict[str, Any]]:
        """What a metrics record takes from the engine: memory by role, skipped steps, loss scale."""
        if self._session is None or not self._session.models:
            return None, {}
        extra: dict[str, Any] = {"skipped_steps": self._session.step_state.skipped_steps}
        if self.config.precision == "fp16":
            extra["loss_scale"] = self.loss_scale
        return self.memory_report(), extra

    def _forward_started(self, module: nn.Module, args: Any) -> None:
        self._guard.heartbeat("in its forward")

    def _policy_save(self, reason: str) -> None:
        path = self.save_state()
        report = self._last_save
        size = f", {report.bytes / 1e9:.2f} GB" if report is not None else ""
        secs = f" in {report.seconds:.2f} s" if report is not None else ""
        say(self._info, f"checkpoint {path} saved{secs}{size} ({reason})")

    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step. Off the boundary nothing is communicated and the prepared
        optimizers and schedulers do nothing; `sync_gradients` says which this is."""
        self._boundary()
        return self.session.accumulate(models, loader_at_end=self._loader_at_end)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()` / grad_accum_steps, x the fp16 loss scale. `num_items=n`: see `shardwise.items`."""
        if self._session is None or not self._session.models:
            raise RuntimeError("backward() before prepare(): prepare the model (and its optimizer) first, "
                               "then compute the loss with the prepared model")
        self._guard.heartbeat("in its backward")
        loader = self._loader
        if loader is not None and (id(loader), loader._iteration) != self._pass:  # a new training pass
            self._pass = (id(loader), loader._iteration)
            self._observer.epoch = loader._iteration if loader._epoch is None else loader._epoch
            self._observer.start_epoch(len(loader) // self.config.grad_accum_steps or None)
        self._observer.at_boundary(self.step, self._probe)  # loops without accumulate() or loaders
        self._observer.on_backward(per_item(loss, kwargs.get("num_items")))  # num_items: a mean per item
        with self._guard.timeouts():
            self.session.backward(loss, **kwargs)

    def unscale_gradients(self) -> None:
        """fp16: unscale every prepared optimizer's gradients now (done once per step)."""
        self.session.unscale_gradients()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients in place; return the total norm over all shards (the unsharded norm).

        Off an accumulation boundary gradients are partial, so nothing is clipped and None is
        returned. The bound applies to this step only.
        """
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): the bound must be a number > 0 "
                             "(a negative bound would scale gradients by a negative factor)")
        with self._guard.timeouts():
            norm = self.session.clip_grad_norm(parameters, max_norm, norm_type)
        self._observer.on_clip(norm)
        return norm

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The compute-dtype context of this run (prepared models already run inside it)."""
        return self.session.strategy.precision.autocast()

    # -- collectives ------------------------------------------------------------------------
    def gather(self, data: Any) -> Any:
        """Concatenate tensors (in nested dicts/lists too) from every process along dim 0."""
        with self._guard.timeouts():
            return map_tensors(data, lambda t: gather_one(t, self.num_processes))

    def gather_for_metrics(self, data: Any) -> Any:
        """`gather`, minus the samples repeated to even out the last batch of the loader."""
        gathered = self.gather(data)
        keep = self._real_in_last_batch()
        return gathered if keep is None else map_tensors(gathered, lambda t: t[:keep])

    def _real_in_last_batch(self) -> int | None:
        """At the last batch of a loader that evened it out with repeated samples: how many of
        the gathered items are real (None: all are)."""
        loader = self._loader
        if loader is None or not self._loader_at_end or loader.remainder() == 0 or loader.tail == "uneven":
            return None
        return loader.remainder()

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """Sum, mean, max or min of tensors across processes."""
        check_reduction(reduction)
        with self._guard.timeouts():
            return map_tensors(data, lambda t: reduce_one(t, reduction, self.num_processes))

    # -- models in ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def init_empty(self) -> Iterator[None]:
        """Build models inside without memory: parameters on the meta device (buffers stay real).

        `prepare` then allocates each process's shards only and initializes the weights with
        the model's own initializers, module by module; the result does not depend on the
        number of processes or the strategy (see `shardwise.materialize`).
        """
        with init_empty() as record:
            yield
        self._init_rng = record.rng

    def load_model(self, model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
                   key_map: dict[str, str] | None = None) -> None:
        """Load safetensors weights into a prepared model: the inverse of `save_model`.

        `path`: a folder written by `save_model`, `shardwise export` or `save_pretrained`, or one
        `.safetensors` file. Keys, shapes and files are checked before any weight changes (`strict=False`
        leaves missing keys and skips unused ones, with a warning; `key_map={'old.': 'new.'}` renames key
        prefixes; a wrapper's `module.` is stripped). Each process reads its shard's rows. A collective.
        """
        strategy = self.session.strategy
        source, found = check_source(path, strategy.unwrap(model), strict=strict, shapes=strategy.full_shapes(model),
                                     key_map=key_map)
        self.session.load_weights(model, source, found)

    def from_pretrained(self, model_class: Any, path: str | os.PathLike[str], *, strict: bool = True,
                        key_map: dict[str, str] | None = None, **config_kwargs: Any) -> nn.Module:
        """A `transformers` model built from the config in `path` without memory; `prepare`
        then loads the weights in `path` into its shards (keys the files lack, such as a new
        classification head, are initialized by the model's own `_init_weights`).

        `model_class`: an `AutoModelFor...` class or a model class; `config_kwargs` override the config
        (`num_labels=2`); `strict`, `key_map` as in `load_model`. Reads local folders (no hub access).
        """
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **config_kwargs)
        with self.init_empty():
            model = (getattr(model_class, "from_config", None) or model_class)(config)
        object.__setattr__(model, PRETRAINED, Pretrained(Path(path), strict, key_map))
        return cast(nn.Module, model)

    # -- models out -------------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module, without the DDP wrapper (an FSDP2 module is its own unwrap); its
        `save_pretrained` refuses while it is sharded: use `save_model` (see `adapters`)."""
        return unwrapped(self.session.strategy.unwrap(model))

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights as CPU tensors on the main process; `{}` on the others.
        A collective: call it on every process."""
        return self.session.strategy.full_state_dict(model)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                   *, merge_adapters: bool = False) -> None:
        """Consolidated weights as safetensors (split above `max_shard_size`, with an index),
        plus config.json for a `transformers` model: `from_pretrained(dir)` loads it. A peft
        model: its adapter folder (`PeftModel.from_pretrained`), or with `merge_adapters` the
        merged full model. Only those files are written or replaced; each is staged beside the
        folder and renamed in, the top file last; checksums: `shardwise verify DIR`. A collective.
        """
        target = Path(save_directory)
        agree(save_problem(self.unwrap_model(model), target, merge_adapters, self.is_main_process))  # before the gather
        state = self.get_state_dict(model)
        problem = None
        if self.is_main_process:
            try:
                save_weights(self.unwrap_model(model), state, target, max_shard_size=max_shard_size,
                             merge_adapters=merge_adapters)
            except CheckpointError as err:
                problem = str(err)
        agree(problem)

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by `load_state`)."""
        return self._session.step_state.optimizer_steps if self._session is not None else 0

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with state_dict/load_state_dict) too."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{type(obj).__name__} has no state_dict()/load_state_dict(); it cannot be checkpointed")
            self._registered.append(obj)

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, *, keep_last: int | None = None
    ) -> Path:
        """Checkpoint everything needed to resume exactly (a collective; sharded, atomic, every
        file checksummed).

        With no folder: `<checkpoint_dir>/step_<N>` (checkpoint_dir is "checkpoints" unless the
        config says otherwise), then `<checkpoint_dir>/latest` points at it and only the newest
        `keep_last` (default: the config's) step folders are kept. A folder given must be absent,
        empty or an earlier checkpoint; anything else (a folder of other files, a file, the
        current directory) is refused with a `CheckpointError` before anything is written.
        """
        from . import checkpoint

        root = Path(self.config.checkpoint_dir)
        target = Path(output_dir) if output_dir is not None else root / f"step_{self.step}"
        keep_last = keep_last if keep_last is not None else self.config.keep_last
        with self._guard.timeouts():
            report = checkpoint.save(self._checkpoint_parts(), target)
        self._last_save = self._guard.saved(report, self.step)  # noted for resume and the launcher
        problem = None
        if output_dir is None and self.is_main_process:
            try:
                checkpoint.mark_latest(target.parent, target, keep_last)
            except OSError as err:
                problem = os_error_line(root / "latest", "point at the new checkpoint", err)
        agree(problem)
        return report.path

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> int | None:
        """Resume from a checkpoint saved at any world size, strategy or offload setting; return
        the optimizer steps it holds.

        With no folder: the newest complete checkpoint under `checkpoint_dir`, or, when there is
        none yet, one line says so and None comes back, so a script calls it unconditionally at
        its start (the `resume` setting; "latest" names it too, but requires one). Prepare the same models,
        optimizers, schedulers and DataLoaders first; the next batch is the one that would have
        come after the save.
        """
        from . import checkpoint, runlock

        if input_dir is None:
            runlock.hold(Path(self.config.checkpoint_dir), self.process_index)  # one run per checkpoint folder
            found = self._guard.resume_from(Path(self.config.checkpoint_dir))  # the `resume` setting
            if found is None:
                return None
            path = found
        else:
            path = Path(input_dir)
            if str(input_dir) == "latest":
                path = Path(self.config.checkpoint_dir) / "latest"
            path = checkpoint.resolve(path)
        with self._guard.timeouts():
            state = checkpoint.load(self._checkpoint_parts(), path)
        session = self.session
        counts: dict[str, list[Any]] = {"schedulers": session.schedulers, "loaders": self._loaders,
                                         "registered": self._registered}
        for key, objs in counts.items():
            if len(state[key]) != len(objs):
                raise CheckpointError(f"{path}: holds {len(state[key])} {key}, {len(objs)} prepared now")
            for obj, sd in zip(objs, state[key]):
                obj.load_state_dict(sd)
        session.step_state.load_state_dict(state)
        saved_accum, saved_world = state.get("grad_accum_steps"), state.get("world_size")
        if (saved_accum, saved_world) != (None, None) and (saved_accum, saved_world) != (
                self.config.grad_accum_steps, self.num_processes):
            if state["micro_step"] % (saved_accum or 1):
                raise CheckpointError(f"{path}: saved in the middle of an accumulation (micro-step "
                                      f"{state['micro_step']} of {saved_accum}); it resumes only with the same "
                                      "processes and grad_accum_steps")
            session.step_state.micro_step = 0  # saved on a boundary: the next micro-step starts one
        session.strategy.precision.load_state_dict(state["scaler"])
        self._guard.last_step = self.step  # no checkpoint of the step just restored
        say(self._info, f"resumed from {path} at step {self.step}")
        return self.step

    def _checkpoint_parts(self) -> Any:
        from .checkpoint import Parts

        session = self.session
        owner = {id(p): i for i, m in enumerate(session.models) for p in m.parameters()}
        return Parts(
            models=session.models,
            unwrapped=[session.strategy.unwrap(m) for m in session.models],
            runners=[o.runner for o in session.optimizers],
            optimizer_models=[owner[id(o.runner.owner_params()[0])] for o in session.optimizers],
            loop_state={
                **session.step_state.state_dict(),  # "micro_step", "step"
                "grad_accum_steps": self.config.grad_accum_steps,
                "world_size": self.num_processes,
                "scaler": session.strategy.precision.state_dict(),
                "schedulers": [s.state_dict() for s in session.schedulers],
                "loaders": [d.state_dict() for d in self._loaders],
                "registered": [o.state_dict() for o in self._registered],
            },
            strategy=session.strategy,
            info={"backend": self.config.backend, "strategy": self.config.strategy, "offload": self.config.offload,
                  "precision": self.config.precision},
            rank=self.process_index,
            world=self.num_processes,
            checkpoint_dir=Path(self.config.checkpoint_dir),  # saves and loads inside it take the run lock
        )

    def memory_report(self) -> MemoryReport:
        """Tensor bytes this process holds for the prepared models and optimizers."""
        session = self.session
        return tensor_memory(session.models, [t for o in session.optimizers for t in o.runner.tensors()])

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        """Release everything prepared on this engine (between two trainings in one process),
        then collect; the objects come back as None. DeepSpeed's engines are destroyed first
        (DeepSpeed's own cleanup of its hooks); a later `prepare` starts afresh, on the same strategy."""
        if self._session is not None:  # a later prepare keeps the strategy launched or chosen (planner: once)
            self._session.release()
            self._session = Session(self.config, make_strategy(self.config, self._info))
        self._loaders, self._loader, self._loader_at_end = [], None, False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    def end_training(self) -> None:
        """Write the last metrics record, close the trackers and leave the process group
        (call once, at the end of the script)."""
        self._guard.at_end(self.step if self._session is not None else 0, self._policy_save)  # the last step
        self._observer.close(self.step if self._session is not None else 0, self._probe)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
