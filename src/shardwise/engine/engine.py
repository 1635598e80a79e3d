"""`Engine`: an ordinary PyTorch loop, sharded. The verbs follow Hugging Face Accelerate.

The engine resolves the config, joins the process group, prepares DataLoaders, and offers the
collectives and checkpoints; models, optimizers, schedulers and the step are its `Session`'s
(`shardwise.engine.session`), and everything that depends on the strategy is the `Strategy`'s.

Words: "Engine" is this user object only. "backend" is the library under the strategies (torch
or DeepSpeed). A "DeepSpeed engine" (`ds_engine`) is DeepSpeed's own `DeepSpeedEngine`, one per
model on that backend. The "loop state" is what a checkpoint keeps besides tensors: step
counters, loss scaler, schedulers, DataLoader positions, registered objects (`engine.pt`, the
file name of checkpoint format 1).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from ..checkpoint import run_record
from ..checkpoint.manager import CheckpointManager
from ..config.batch import resolve_grad_accum
from ..config.parallelism import data_parallel_size
from ..config.tree import EngineConfig, is_auto
from ..distributed.collectives import check_reduction, gather_one, map_tensors, reduce_one, whole
from ..distributed.mesh import ParallelDims
from ..distributed.world import init_distributed, leave_process_groups, new_background_group
from ..runtime.memory import MemoryReport, tensor_memory
from ..runtime.observe import Observer, TrackerVerbs
from ..runtime.supervision import Supervisor, say
from ..strategies import make_strategy
from ..strategies.compile import compile_boundary
from ..strategies.expert_parallel import take_load
from ..strategies.frozen import check_inference_models, for_inference
from ..strategies.precision import check_device_supports
from ..strategies.steps import model_parallel_trial
from ..weights.adapters import attach_full_weights
from ..weights.ema import PreparedEMA, adopt_at_first_step, bind, journal_calls, shard
from . import boundary
from .data import PreparedDataLoader, check_unsplit, first_samples, move_to_device
from .items import per_item
from .lone import LoneCalls
from .loop_rules import LoopRules
from .loop_state import LoaderTracker, checkpoint_parts, config_from_code, kind_of, restore_loop_state
from .models import ModelVerbs
from .optim import PreparedOptimizer, PreparedScheduler, build_optimizer, build_scheduler
from .process import ProcessVerbs
from .session import Session, check_optimizer

log = logging.getLogger("shardwise")


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (every device) on this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Chooser:
    """strategy="auto"'s chooser, handed to the engine from above (`shardwise/__init__.py`
    registers `plan.auto.choose`): the planner traces the engine's own session, so the engine
    must not import it (one direction between the two packages)."""

    choose: Callable[..., tuple[EngineConfig, Any]] | None = None


AUTO_CHOOSER = _Chooser()


class Engine(ProcessVerbs, TrackerVerbs, ModelVerbs):
    """Runs a PyTorch training loop under ddp, zero1, zero2 or zero3 on one or many processes.

    Keywords fill an `EngineConfig` (see its fields for the meaning of each); Accelerate's
    `mixed_precision` ("no", "fp16", "bf16") and `gradient_accumulation_steps` are accepted too.
    Under `shardwise launch` (or with SHARDWISE_CONFIG / `--config FILE`) the resolved config file
    comes first and keywords given in code override it, with one warning naming both values.
    `rules`: where the loop differs from Accelerate's (`LoopRules`; `Accelerator` passes its own).
    """

    def __init__(self, config: EngineConfig | None = None, *, rules: LoopRules | None = None,
                 **kwargs: Any) -> None:
        config, conflicts = config_from_code(config, kwargs)
        self._config = cfg = config
        self._rules = rules if rules is not None else LoopRules()
        self._info = init_distributed(force_cpu=cfg.training.cpu,
                                      timeout_s=cfg.supervision.collective_timeout_s)
        if conflicts and self._info.is_main:
            warnings.warn("code overrides the config file: " + "; ".join(conflicts), stacklevel=2)
        check_device_supports(cfg.sharding.precision, self._info.device)
        # strategy="auto" is chosen at the first prepare, from the model and its batch
        self._session: Session | None = None
        if not is_auto(cfg.sharding.strategy):
            self._session = self._new_session(cfg)
        self.plan: Any = None  # strategy="auto": the plan the choice came from
        if cfg.training.seed is not None:  # only a seed the user gave: a script's own set_seed() stands
            set_seed(cfg.training.seed)
        self._loaders = LoaderTracker()  # the prepared loaders, and which one yielded the last batch
        self._registered: list[Any] = []
        self._save_by_policy: Callable[[], Path] = self.save_state  # `save_policy_checkpoints_with`
        # the run's checkpoints: naming, run lock, background writer, resume (`checkpoint.manager`)
        self._checkpoints = CheckpointManager(cfg.checkpointing, rank=self._info.rank,
                                              local_main=self._info.is_local_main,
                                              say=lambda message: say(self._info, message),
                                              make_group=new_background_group, device=self._info.device)
        self._init_rng: torch.Tensor | None = None  # init_empty(): the generator state it began with
        self._pretrained_saves: dict[int, int] = {}  # save_pretrained calls this step (arrival keys)
        self.noun = "engine"  # what messages call this object (the Accelerator: "accelerator")
        self._emas: list[PreparedEMA] = []  # EMAs passed to prepare (`shardwise.weights.ema`)
        self.optimizer: PreparedOptimizer | None = None  # built from config.optimizer, if any
        self.scheduler: PreparedScheduler | None = None  # built from config.scheduler, if any
        self._supervisor = Supervisor(cfg.supervision, cfg.checkpointing, self._info)  # preemption, timeouts
        self._observer = Observer(cfg.observation, self._info)  # metrics, trackers, progress
        # the main process's calls alone after wait_for_everyone(), served by the others (`engine.lone`)
        self._lone = LoneCalls(self._info, cfg.supervision.collective_timeout_s,
                               lambda: self._session.models if self._session is not None else [],
                               lambda: self._emas, self.unwrap_model, self._whole_weights)
        atexit.register(self._lone.at_exit)  # a script's end is a call every process makes
        # a batch counts once per group of processes that take the same samples (the layout's)
        self._observer.meter.same_samples = lambda: dims.non_data_parallel if (dims := self._dims()) else 1
        # between two optimizer steps, in this order (`shardwise.engine.boundary`)
        self._boundary_hooks = boundary.StepBoundary()
        self._boundary_hooks.add("observation", lambda step: self._observer.at_boundary(step, self._probe))
        self._boundary_hooks.add("supervision", self._supervise)
        self._boundary_hooks.add("compile watch", lambda step: compile_boundary(step, self._info))
        restarts = run_record.attempt()
        if restarts:
            say(self._info, f"the worker group was restarted ({restarts} restart(s) so far)")

    def _new_session(self, cfg: EngineConfig) -> Session:
        """A session on the strategy `cfg` describes; each part gets its own section."""
        loop = cfg.training
        return Session(cfg.blocks, make_strategy(cfg, self._info), grad_accum_steps=loop.grad_accum_steps,
                       max_grad_norm=loop.max_grad_norm)

    @property
    def config(self) -> EngineConfig:
        """The resolved config (read-only: `set_grad_accum` changes grad_accum_steps)."""
        return self._config

    def set_grad_accum(self, steps: int) -> None:
        """Micro-steps per optimizer step from now on: the one setter of grad_accum_steps (the
        config and the session's step state, which divides the loss and finds the boundary)."""
        self._config = self._config.with_keys(grad_accum_steps=int(steps))
        if self._session is not None:
            self._session.set_grad_accum(self._config.training.grad_accum_steps)

    @property
    def rules(self) -> LoopRules:
        """Where this loop's rules differ from Accelerate's (`shardwise.engine.loop_rules`)."""
        return self._rules

    def set_rules(self, rules: LoopRules) -> None:
        """The rules DataLoaders prepared from now on follow (prepared ones keep theirs; `set_tail`)."""
        self._rules = rules

    def set_tail(self, tail: str) -> None:
        """How every prepared DataLoader's next pass, and every later one, splits its last
        incomplete global batch ("split", "full", "uneven")."""
        self._rules = dataclasses.replace(self._rules, tail=tail)
        for loader in self._loaders.loaders:
            loader.set_tail(tail)

    @property
    def session(self) -> Session:
        """The strategy and what was prepared on it (strategy='auto': from the first prepare)."""
        if self._session is None:
            raise RuntimeError(
                "strategy='auto' chooses the strategy at the first prepare(); prepare the model "
                "(and its DataLoader) before this call"
            )
        return self._session

    # -- the loop ---------------------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step that ends an accumulation (gradients are communicated)."""
        return self._session is None or self._session.step_state.sync

    def set_micro_step(self, sync: bool) -> None:
        """For a loop that counts its own accumulation (transformers' Trainer, which prefetches a
        step's batches, so no loader can say where a step ends): the coming micro-step ends an
        accumulation iff `sync` (the backward communicates and the optimizers step then)."""
        if self._session is not None:
            self._session.step_state.set_sync(sync)

    @property
    def prepared_models(self) -> list[nn.Module]:
        """The models prepared so far (none before the first prepare)."""
        return list(self._session.models) if self._session is not None else []

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self._session is not None and any(o.step_was_skipped for o in self._session.optimizers)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 when nothing is scaled, or DeepSpeed scales)."""
        return self._session.strategy.precision.loss_scale if self._session is not None else 1.0

    @property
    def logging_dir(self) -> Path:
        """The folder the trackers' runs go into (`<project_dir>/logs` unless set)."""
        return self._observer.logging_dir

    def set_logging_root(self, folder: Path | None) -> None:
        """Trackers' runs go to `<folder>/<run>` (None: `<project_dir>/logs/<run>`)."""
        self._observer.root = folder

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Shard models, rebind optimizers, split DataLoaders, wrap schedulers.

        Any order and number; the results come back in the same order (one object: itself).
        Everything is checked before anything is changed.
        """
        kinds = [kind_of(obj, self._session) for obj in objects]
        of = {kind: [o for o, k in zip(objects, kinds) if k == kind]
              for kind in ("model", "optimizer", "scheduler", "dataloader", "ema")}
        for loader in of["dataloader"]:
            self._check_batch_sizes(loader)
        known = self._session.param_ids if self._session is not None else set()
        check_inference_models([*of["model"], *(self._session.models if self._session else [])],
                               of["optimizer"])
        for optimizer in of["optimizer"]:
            check_optimizer(optimizer, of["model"], known)
        if self._session is None:
            choose = AUTO_CHOOSER.choose
            if choose is None:
                raise RuntimeError("strategy='auto' needs the planner: import shardwise (which registers it)")
            self._config, self.plan = choose(self.config, self._info, of["model"], of["dataloader"])
            self._session = self._new_session(self.config)
        session = self._session
        session.init_rng = self._init_rng
        self._trial(session, of["model"], of["dataloader"])
        for model in of["model"]:
            self._observer.watch(model)
        prepared = session.prepare(of["model"], of["optimizer"], of["scheduler"])
        for model in of["model"]:  # the heartbeat that says who did not arrive if a collective hangs
            ready = prepared[id(model)]
            ready.register_forward_pre_hook(self._forward_started, prepend=True, with_kwargs=True)
            # ... and before its generate (FSDP2 gathers the root for the whole generation first)
            self._lone.watch_generate(self.unwrap_model(ready),
                                      functools.partial(self._generate_started, ready))
            # its own save_pretrained, called on every process, gathers through this engine
            attach_full_weights(self.unwrap_model(ready), self._full_weights(ready))
        for ema in of["ema"]:  # an EMA of a prepared model: its shadows take the model's layout
            self._adopt_ema(ema)
            prepared[id(ema)] = ema
        adopt_at_first_step(self._adopt_ema_of)  # ... and one built before prepare, never passed to it
        journal_calls(self._lone.record)  # EMA calls the others replay when they serve a lone call
        for loader in of["dataloader"]:
            prepared[id(loader)] = self._prepare_loader(loader)
            self._loaders.loaders.append(prepared[id(loader)])
        for scheduler in of["scheduler"]:  # the rules' scheduler stepping (Accelerate: per process)
            prepared[id(scheduler)].steps_per_call = self._rules.scheduler_steps_per_call(self.num_processes)
            prepared[id(scheduler)].step_with_optimizer = self._rules.step_scheduler_with_optimizer
        trained = [m for m in of["model"] if not for_inference(m)]  # a frozen reference gets no optimizer
        if trained and not of["optimizer"] and not session.optimizers and self.config.optimizer:
            loaders = [prepared[id(o)] for o in of["dataloader"]]
            self._build_from_config(prepared[id(trained[0])], loaders[0] if loaders else None)
        out = tuple(prepared[id(o)] for o in objects)
        return out[0] if len(out) == 1 else out

    @staticmethod
    def _trial(session: Session, models: list[nn.Module], loaders: list[Any]) -> None:
        """What only a forward shows, refused before any model is changed: each model run on the
        meta device with the first DataLoader's first samples (`steps.model_parallel_trial`; read
        only when a model's steps need them, once)."""
        if not loaders:
            return

        @functools.cache
        def samples() -> Any:
            batch = first_samples(loaders[0])
            return None if batch is None else move_to_device(batch, torch.device("meta"))

        strategy = session.strategy
        for model in models:
            if "tp" not in strategy.own_steps:
                model_parallel_trial(model, strategy.dims, strategy.cfg.parallelism, samples)

    def _prepare_loader(self, loader: Any) -> PreparedDataLoader:
        """This process's share of `loader`, split and ordered by the rules (`shardwise.engine.data`)."""
        rules = self._rules
        seedable = rules.seedable_sampler and rules.data_seed is not None
        seed = rules.data_seed if seedable else self.config.training.seed
        dims = self.session.strategy.dims  # the data-parallel ranks split the data (`distributed.mesh`)
        check_unsplit(loader)
        same = dims.tp * dims.cp  # the processes that take the same batch
        if same > 1 and loader.batch_size is not None:  # (sized by num_processes: a fraction of the batch)
            named = (("tensor_parallel_size", dims.tp), ("context_parallel_size", dims.cp))
            sizes = " x ".join(f"{key} {n}" for key, n in named if n > 1)
            say(self._info, f"{sizes}: the DataLoader is split over {dims.dp_size} data-parallel rank(s), "
                f"not {self.num_processes} processes (the {same} processes of a tp x cp group take the same "
                f"batch): {loader.batch_size} x {dims.dp_size} = {loader.batch_size * dims.dp_size} samples "
                "per micro-step")
        return PreparedDataLoader(
            loader, world=dims.dp_size, rank=dims.dp_rank(self.process_index), device=self.device,
            on_batch=self._on_batch, seed=seed, tail=rules.tail, split_batches=rules.split_batches,
            seedable=rules.seedable_sampler, resume_draws=rules.resume_draws,
            on_end=self._loaders.ended if rules.restore_outer_loader else None,
            on_pass=lambda: self._lone.common("a DataLoader pass"),
        )

    def _build_from_config(self, model: nn.Module, loader: PreparedDataLoader | None) -> None:
        """The optimizer (and schedule) the config describes, for a script that passes none;
        they are `engine.optimizer` and `engine.scheduler`."""
        assert self.config.optimizer is not None
        raw = build_optimizer(self.config.optimizer, model)
        self.optimizer = self.session.add_optimizer(raw)
        log.info("built %s from the config", type(raw).__name__)
        if self.config.scheduler is not None:
            steps = len(loader) // self.config.training.grad_accum_steps if loader is not None else None
            built = build_scheduler(self.config.scheduler, raw, steps)
            self.scheduler = self.session.add_scheduler(built)

    def _check_batch_sizes(self, loader: Any) -> None:
        micro = self.config.training.micro_batch_size
        if isinstance(micro, int) and micro != loader.batch_size and self.is_main_process:
            warnings.warn(
                f"the DataLoader in code has batch_size={loader.batch_size}, the config says "
                f"micro_batch_size={micro}; the code's value is used",
                stacklevel=3,
            )
        if loader.batch_size is not None:
            accum = resolve_grad_accum(self.config, loader.batch_size, self.num_processes)
            if accum != self.config.training.grad_accum_steps:
                cfg, n = self.config, self.num_processes
                dp = data_parallel_size(cfg.parallelism, n)
                ranks = (f"{n} process(es)" if dp == n else
                         f"{dp} data-parallel rank(s) ({n} processes / tp {n // dp})")
                say(self._info, f"train_batch_size={self.config.training.train_batch_size} at {ranks} "
                    f"x batch {loader.batch_size}: grad_accum_steps "
                    f"{self.config.training.grad_accum_steps} -> {accum}")
                self.set_grad_accum(accum)

    # -- the step ---------------------------------------------------------------------------
    def _on_batch(self, loader: PreparedDataLoader, last: bool, batch: Any) -> None:
        self._boundary()  # before the batch counts as served: a checkpoint here resumes with it
        self._loaders.on_batch(loader, last, restore_outer=self._rules.restore_outer_loader)
        self._observer.on_batch(batch)

    @property
    def active_loader(self) -> PreparedDataLoader | None:
        """The prepared DataLoader that yielded the last batch (None before any, or, with
        `LoopRules.restore_outer_loader`, after its loop ended outside any other)."""
        return self._loaders.active

    @property
    def loader_at_end(self) -> bool:
        """The last batch yielded was its loader's last (the accumulation ends there)."""
        return self._loaders.at_end

    def _boundary(self) -> None:
        """Once per optimizer step, before the next one's work: observation, supervision, the
        compile watch (`shardwise.engine.boundary`). Every process gets here."""
        self._lone.common("a step boundary")
        if self._session is not None and self._session.models:
            self._boundary_hooks.reach(self._session.step_state.optimizer_steps)

    def _supervise(self, step: int) -> None:
        """The boundary's supervision: the processes' agreed decision, acted on."""
        decision = self._supervisor.at_boundary(step, write_failed=self._checkpoints.failed)
        boundary.act(decision, step, checkpoints=self._checkpoints, supervisor=self._supervisor,
                     save=self._policy_save, info=self._info)

    @property
    def checkpoints(self) -> CheckpointManager:
        """This engine's checkpoint manager (naming, run lock, background writer, resume)."""
        return self._checkpoints

    def _probe(self) -> tuple[MemoryReport | None, dict[str, Any]]:
        """What a metrics record takes from the engine: memory by role, skipped steps, loss scale."""
        if self._session is None or not self._session.models:
            return None, {}
        extra: dict[str, Any] = {"skipped_steps": self._session.step_state.skipped_steps}
        if self._session.strategy.precision.dtype is torch.float16:  # loss-scaled (by us or DeepSpeed)
            extra["loss_scale"] = self.loss_scale
        load = take_load(list(self._session.models), self._observer.meter.steps_since_record, self.device)
        if load is not None:  # expert parallelism: token slots per expert per step, per MoE layer
            extra["tokens_per_expert"] = load
        return self.memory_report(), extra

    def _forward_started(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # a training forward (every process runs it) is a boundary too: a loop with neither a
        # prepared DataLoader nor accumulate() reaches it only here (a no-op when it was reached)
        if torch.is_grad_enabled():
            self._boundary()
        else:
            self._no_grad_call(module, args, kwargs, "forward")
        self._supervisor.heartbeat("in its forward")

    def _generate_started(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        with torch.no_grad():  # (generate's own no_grad is inside it)
            self._no_grad_call(module, args, kwargs, "generate")

    def _no_grad_call(self, module: nn.Module, args: Any, kwargs: Any, kind: str) -> None:
        """A no-grad forward or a generate of a prepared model: a lone one after a barrier is
        served (`engine.lone`); else, under the Accelerator, one on a process alone is refused."""
        if not self._lone.forward(module, args, kwargs, kind):
            solo = getattr(module, "_shardwise_solo", None)  # the Accelerator's arrival check (sharded)
            if solo is not None:
                solo(module, args)

    def save_policy_checkpoints_with(self, save: Callable[[], Path]) -> None:
        """Checkpoints by policy (`checkpoint_every_*`, preemption, the end) call `save()`
        instead of `save_state()` (`Accelerator`: with Accelerate's naming)."""
        self._save_by_policy = save

    def _policy_save(self, reason: str) -> None:
        path = self._save_by_policy()
        report = self._checkpoints.last_report
        if report is not None and report.pending:  # checkpoint_async: the write's own line follows in the log
            say(self._info, f"checkpoint {path} staged in {report.stall:.2f} s (the training's stall), "
                f"written in the background ({reason})")
            return
        size = f", {report.bytes / 1e9:.2f} GB" if report is not None else ""
        secs = f" in {report.seconds:.2f} s (stall {report.stall:.2f} s)" if report is not None else ""
        say(self._info, f"checkpoint {path} saved{secs}{size} ({reason})")

    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step. Off the boundary nothing is communicated and the prepared
        optimizers and schedulers do nothing; `sync_gradients` says which this is."""
        self._boundary()
        return self.session.accumulate(models, loader_at_end=self.loader_at_end,
                                       sync_each_batch=self._rules.sync_each_batch)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()` / grad_accum_steps, x the fp16 loss scale. `num_items=n`: see
        `shardwise.engine.items`."""
        if self._session is None or not self._session.models:
            raise RuntimeError("backward() before prepare(): prepare the model (and its optimizer) first, "
                               "then compute the loss with the prepared model")
        self._supervisor.heartbeat("in its backward")
        loader = self._loaders.new_pass()
        if loader is not None:  # a new training pass
            self._observer.epoch = loader.iteration if loader.epoch is None else loader.epoch
            self._observer.start_epoch(len(loader) // self.config.training.grad_accum_steps or None)
        # num_items: a mean per item; a loss-parallel loss is a DTensor, replicated: its local value
        self._observer.on_backward(per_item(whole(loss), kwargs.get("num_items")))
        with self._supervisor.timeouts():
            self.session.backward(loss, **kwargs)

    def unscale_gradients(self) -> None:
        """fp16: unscale every prepared optimizer's gradients now (done once per step)."""
        self.session.unscale_gradients()

    def clip_grad_norm_(self, parameters: Any, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients in place; return the total norm over all shards (the unsharded norm).

        Off an accumulation boundary gradients are partial, so nothing is clipped and None is
        returned. The bound applies to this step only.
        """
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): the bound must be a number > 0 "
                             "(a negative bound would scale gradients by a negative factor)")
        with self._supervisor.timeouts():
            norm = self.session.clip_grad_norm(parameters, max_norm, norm_type)
        self._observer.on_clip(norm)
        return norm

    def loss_parallel(self) -> contextlib.AbstractContextManager[Any]:
        """With tensor parallelism and a head planned `colwise_loss_parallel` (its logits split
        over the vocabulary, never whole on one rank): compute the loss and call `backward`
        inside this context (torch's `loss_parallel`: cross-entropy on the split logits). Without
        tensor parallelism it does nothing."""
        tp = self._session.strategy.dims.tp if self._session is not None else 1
        return loss_parallel() if tp > 1 else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The compute-dtype context of this run (prepared models already run inside it)."""
        return self.session.strategy.precision.autocast()

    # -- collectives ------------------------------------------------------------------------
    def gather(self, data: Any) -> Any:
        """Concatenate tensors (in nested dicts/lists too) from every process along dim 0."""
        self._lone.common("gather")
        dims = self._dims()
        keep = None if dims is None or dims.non_data_parallel == 1 else dims.leaders()
        with self._supervisor.timeouts():
            return map_tensors(data, lambda t: gather_one(whole(t), self.num_processes, keep))

    def gather_for_metrics(self, data: Any) -> Any:
        """`gather`, minus the samples repeated to even out the last batch of the loader."""
        gathered = self.gather(data)
        keep = self.real_in_last_batch()
        return gathered if keep is None else map_tensors(gathered, lambda t: t[:keep])

    def real_in_last_batch(self) -> int | None:
        """At the last batch of a loader that evened it out with repeated samples: how many of
        the gathered items are real (None: all are)."""
        return self._loaders.real_in_last_batch()

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """Sum, mean, max or min of tensors across processes."""
        check_reduction(reduction)
        self._lone.common("reduce")
        dims = self._dims()
        copies = 1 if dims is None else dims.non_data_parallel  # (processes taking the same samples)
        with self._supervisor.timeouts():
            return map_tensors(data, lambda t: reduce_one(whole(t), reduction, self.num_processes, copies))

    def _dims(self) -> ParallelDims | None:
        """The run's layout (None before `strategy="auto"` chose one at the first prepare)."""
        return self._session.strategy.dims if self._session is not None else None

    @property
    def parallel_dims(self) -> ParallelDims:
        """The run's parallel layout (`distributed.mesh.ParallelDims`): its sizes (`dp_replicate`,
        `dp_shard`, `tp`, ...; `dp_size`: the data-parallel ranks a loader is split over), this
        process's ranks (`dp_rank(engine.process_index)`, `tp_rank(...)`), and `get_mesh(name)`
        for a named view ("batch", "loss", "fsdp", "tp", ...). Size a DataLoader by `dp_size`,
        not `num_processes`: the processes of a tensor-parallel group take the same batch."""
        dims = self._dims()
        if dims is None:
            raise RuntimeError("parallel_dims: strategy='auto' chooses the layout at the first prepare(); "
                               "ask for it after that, or name the strategy")
        return dims

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by `load_state`)."""
        return self._session.step_state.optimizer_steps if self._session is not None else 0

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with state_dict/load_state_dict) too."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{type(obj).__name__} has no state_dict()/load_state_dict(); "
                                "it cannot be checkpointed")
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
        `checkpoint_async`: the state is copied to host memory and this returns; the folder (and
        `latest`) appear once a writer thread has written it (`shardwise.checkpoint.background`).
        """
        self._lone.common("save_state")
        with self._supervisor.timeouts():
            report = self._checkpoints.save(self._checkpoint_parts(), self.step,
                                            Path(output_dir) if output_dir is not None else None,
                                            keep_last=keep_last)
        return Path(report.path)

    def wait_for_checkpoint(self) -> float:
        """Block until a checkpoint being written in the background (`checkpoint_async`) is in
        place, raising its failure if it failed; the seconds waited (0.0 when none is pending)."""
        return self._checkpoints.wait()

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> int | None:
        """Resume from a checkpoint saved at any world size, strategy or offload setting; return
        the optimizer steps it holds.

        With no folder: the newest complete checkpoint under `checkpoint_dir`, or, when there is
        none yet, one line says so and None comes back, so a script calls it unconditionally at
        its start (the `resume` setting; "latest" names it too, but requires one). Prepare the same models,
        optimizers, schedulers and DataLoaders first; the next batch is the one that would have
        come after the save.
        """
        self._lone.common("load_state")
        with self._supervisor.timeouts():
            loaded = self._checkpoints.load(self._checkpoint_parts, input_dir)
        if loaded is None:
            return None
        state, path = loaded
        restore_loop_state(state, path, self.session, self._checkpointed_loaders(), self._registered,
                           self.num_processes, loader_positions=self._rules.restore_loader_position)
        self._boundary_hooks.passed(self.step)  # no checkpoint of the step just restored
        say(self._info, f"resumed from {path} at step {self.step}")
        return self.step

    def _adopt_ema(self, ema: Any) -> None:
        """`ema`'s shadows follow a prepared model's parameters: cut to its layout, gathered for
        the save hooks (`whole_emas`)."""
        self._emas.append(bind(ema, [self.unwrap_model(m) for m in self.session.models]))
        shard(self._emas[-1])

    def _adopt_ema_of(self, ema: Any, params: list[torch.Tensor]) -> bool:
        """An EMA at its first `step` on `params` with whole shadows: this engine's if it prepared
        them (then adopted, as if passed to `prepare`)."""
        session = self._session
        if session is None or not any(id(p) in session.param_ids for p in params):
            return False
        known = [p for p in self._emas if p.ema is ema]
        if known:  # adopted before; its shadows were replaced by whole ones since (load_state_dict)
            shard(known[0])
            return True
        self._adopt_ema(ema)
        say(self._info, f"{type(ema).__name__} built before prepare() follows the prepared model: its "
                        "shadows are sharded like its parameters (as if passed to prepare)")
        return True

    def _checkpointed_loaders(self) -> list[PreparedDataLoader]:
        return self._loaders.loaders if self._rules.loaders_in_checkpoint else []

    def _checkpoint_parts(self) -> Any:
        return checkpoint_parts(self.session, self._checkpointed_loaders(), self._registered, self.config,
                                self.process_index, self.num_processes)

    def memory_report(self) -> MemoryReport:
        """Tensor bytes this process holds for the prepared models and optimizers (and the host
        copy of a checkpoint being written in the background: `staging`)."""
        session = self.session
        return tensor_memory(session.models, [t for o in session.optimizers for t in o.runner.tensors()],
                             staging=self._checkpoints.staging_bytes())

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        """Release everything prepared on this engine (between two trainings in one process),
        then collect; the objects come back as None. DeepSpeed's engines are destroyed first
        (DeepSpeed's own cleanup of its hooks); a later `prepare` starts afresh, on the same strategy."""
        self._checkpoints.wait()  # a checkpoint being written (checkpoint_async) completes, its copy is freed
        if self._session is not None:  # a later prepare keeps the strategy launched or chosen (planner: once)
            self._session.release()
            self._session = self._new_session(self.config)
        self._loaders.reset()
        self._emas.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    def end_training(self) -> None:
        """Write the last metrics record, close the trackers and leave the process group
        (call once, at the end of the script)."""
        step = self.step if self._session is not None else 0
        # every process's last heartbeat: a call the main process then makes alone (a script's
        # sampling under `if accelerator.is_main_process:`) is seen as alone at once, not after
        # the arrival wait (`distributed.arrival`)
        self._supervisor.heartbeat("ending the run")
        self._lone.common("end_training")
        self._checkpoints.wait()  # a checkpoint being written (checkpoint_async) completes first
        policy = self.config.checkpointing.every_steps or self.config.checkpointing.every_seconds
        if policy and step > 0 and not self._checkpoints.has_saved(step):  # (resumed at its last step: saved)
            self._policy_save("the end of training")  # every process is here: its collectives are safe
        self._checkpoints.close()  # the last save is complete before the process group goes
        self._supervisor.settle()  # the boundary's agreement in flight, before the process group goes
        self._supervisor.close()
        self._observer.close(self.step if self._session is not None else 0, self._probe)
        leave_process_groups()  # (a barrier first: every process is done with every collective)
