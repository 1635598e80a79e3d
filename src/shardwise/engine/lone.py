"""Calls the main process makes alone after `wait_for_everyone()`, served by the others.

diffusers' `train_unconditional.py`, like many scripts written for Accelerate, ends each epoch
with `accelerator.wait_for_everyone()` and then, under `if accelerator.is_main_process:`, swaps
its EMA weights into the model, samples with it and saves it. On a model whose parameters are
sharded across processes (zero3 on either backend, hybrid) every forward all-gathers each layer
from every process, and `save_pretrained` gathers the weights: alone, the main process would
wait for the others forever. Here the others serve those calls.

**The rendezvous.** After each `wait_for_everyone()` barrier, every process's next call of a
kind that involves the others (its "event": a pass of a prepared DataLoader, a step boundary, a
training forward, a no-grad forward or a `save_pretrained` of a sharded model, `gather`,
`reduce`, `get_state_dict`, `save_model`, `save_state`, `load_state`, `wait_for_everyone`,
`end_training`, the interpreter's exit) meets the main process's: each
other process posts which event it is at in the process group's store and waits for the main
process's word. The main process, at its own next event:
- one the others make too (a training forward, a boundary, ...): the word is "together";
- a no-grad forward, a `generate` or a `save_pretrained` of a sharded model: "together" when
  every other process posted the same call (an evaluation every process runs), else "serve".

**Serving.** Until the main process reaches an event the others make too, each of its
no-grad forwards, `generate`s and `save_pretrained` gathers of a sharded model is sent to the others
(`broadcast_object_list` on a gloo group of its own, so it never interleaves with the
training's collectives) and run by them as well, so every collective of it is matched:
- a forward with the main process's inputs (as CPU tensors) and modules' train/eval modes,
  under no_grad, with the others' random state kept (`fork_rng`); its output is dropped;
- a `generate` the same way, run from the main process's random state (so a sampled generation
  takes the same path and as many forwards on every process), the others' own kept; the
  forwards inside it are its own, never sent one by one. The engine's check comes before the
  instance's `generate` (`watch_generate`), so before FSDP2 gathers the root's parameters for
  the whole generation;
- a gather of the whole weights (`Engine.get_state_dict`; the main process writes);
- before each, the EMA calls the main process made since the barrier (diffusers' `EMAModel`
  `store`, `copy_to`, `restore` on a prepared model's parameters, `weights.ema`) are replayed:
  the EMA weights the main process copied into its shards must be in the others' shards too.
At its next event the others make too, the main process sends "done" (after its last EMA
calls, a `restore`) and every process goes on with that event.

Cost: one store round trip per process at the first event after each barrier, and only while
some prepared model holds a shard (`holds_shards`: FSDP2's or DeepSpeed ZeRO-3's; under ddp and
zero1/2 nothing changes: a lone call there runs alone). Limits: the lone calls are told from
the others' by what the others are at; when they are at the same kind of call (a no-grad
forward of the same model), the main process's lone forward counts as theirs, as it did before.
A lone call's other changes to the model on the main process (an in-place edit of its own
parameters) are not mirrored, only the EMA calls.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.internals import default_store, holds_shards
from ..distributed.world import DistInfo, new_background_group
from ..runtime.supervision import say
from ..weights.ema import PreparedEMA

_KEY = "shardwise/lone"
_POLL_S = 0.002
_WATCHED = "_shardwise_lone_generate"  # marks a generate `watch_generate` put on an instance


class LoneCalls:
    """One engine's rendezvous after barriers and its serving of the main process's lone calls
    (see the module). `models()`: the prepared models; `emas()`: the EMAs that follow them;
    `unwrap(model)`: its module; `gather(model)`: its whole weights (a collective)."""

    def __init__(self, info: DistInfo, wait_s: float, models: Callable[[], list[nn.Module]],
                 emas: Callable[[], list[PreparedEMA]], unwrap: Callable[[nn.Module], nn.Module],
                 gather: Callable[[nn.Module], Any]) -> None:
        self.info, self.wait_s = info, wait_s
        self.models, self.emas, self.unwrap, self.gather = models, emas, unwrap, gather
        self.barriers = 0  # wait_for_everyone barriers passed (the same count on every process)
        self.armed = False  # after a barrier, until this process's first event
        self.serving = False  # the main process: the others run its calls
        self.replaying = False  # another process: inside a call it serves
        self.generating = 0  # inside a prepared model's generate (nested calls counted)
        self.journal: list[tuple[int, str, int]] = []  # main: (EMA, method, model) since the barrier
        self._calls: dict[str, int] = {}  # the main process: calls sent in this service, by kind
        self._group: dist.ProcessGroup | None = None

    # -- the events ---------------------------------------------------------------------------
    def after_barrier(self) -> None:
        """Every process, after `wait_for_everyone`'s barrier: its next event meets the main
        process's. (A collective the first time: the serving group is made here.)"""
        self.barriers += 1
        self.journal.clear()
        self.armed = self.info.world_size > 1 and dist.is_initialized() and any(
            self.sharded(m) for m in self.models())
        if not self.armed:
            return
        if self._group is None:
            self._group = new_background_group()
        if self.info.is_main and self.barriers > 1:  # every process read the last barrier's keys
            store, n = default_store(), self.barriers - 1
            for key in [f"{_KEY}/{n}", *(f"{_KEY}/{n}/{r}" for r in range(1, self.info.world_size))]:
                with contextlib.suppress(Exception):
                    store.delete_key(key)

    def common(self, event: str) -> None:
        """An event every process makes (a training forward, a boundary, a loader's pass, a
        collective, a save, the end): the main process ends its service or says "together";
        another process at its first event since the barrier serves the main process if told."""
        if self.info.is_main:
            if self.serving:
                self.serving = False
                self._send(("done",))
                say(self.info, f"the main process's {self._counts()} alone after wait_for_everyone(): the "
                    f"other processes ran them with it, until {event}")
                self._calls.clear()
            elif self.armed:
                default_store().set(f"{_KEY}/{self.barriers}", "together")
            self.armed = False
            self.journal.clear()
        elif self.armed:
            self.armed = False
            if self._word(event) == "serve":
                self._serve()

    def at_exit(self) -> None:
        """The interpreter's exit (registered by the engine with `atexit`) is an event too: a
        script that ends without `end_training()` right after `wait_for_everyone()` while the
        main process saves alone (`if accelerator.is_main_process: model.save_pretrained(...)`)
        is served there. Nothing happens unless a rendezvous or a service is pending."""
        if (self.armed or self.serving) and dist.is_initialized():
            self.common("the end of the script")

    def forward(self, module: nn.Module, args: Any, kwargs: Any, kind: str = "forward") -> bool:
        """A no-grad forward (the engine's forward hook) or a `generate` (`kind`) of a prepared
        model: `maybe_alone` when a rendezvous or a service is pending and the model is sharded;
        False (nothing read, no parameter walked) otherwise, as in every evaluation loop with
        nothing pending. A forward inside a generate the others run too is decided (True)."""
        if not (self.armed or self.serving or self.replaying) or not self.sharded(module):
            return False
        if kind == "forward" and self.generating and self.serving:
            return True  # (the main process: inside its generate, which the others run)
        index = self.index(module)
        event = "a no-grad forward" if kind == "forward" else "a generate"
        return index is not None and self.maybe_alone(
            f"{event} of model {index}", lambda: self.forward_command(module, args, kwargs, kind))

    def watch_generate(self, target: nn.Module, before: Callable[[Any, Any], None]) -> None:
        """Put `before(args, kwargs)` (the engine's checks) ahead of `target`'s own `generate`, the
        instance's that the strategy set on a sharded model (`sync_generate`; FSDP2 gathers the
        root in it, before any forward); nothing when it set none."""
        generate = target.__dict__.get("generate")
        if not callable(generate) or getattr(generate, _WATCHED, False):
            return

        @functools.wraps(generate)
        def watched(*args: Any, **kwargs: Any) -> Any:
            before(args, kwargs)
            self.generating += 1
            try:
                return generate(*args, **kwargs)
            finally:
                self.generating -= 1

        setattr(watched, _WATCHED, True)
        target.__dict__["generate"] = watched

    def maybe_alone(self, event: str, command: Callable[[], tuple[Any, ...]]) -> bool:
        """A call the main process may make alone (a no-grad forward or a `save_pretrained` of a
        sharded model; `command()` says how the others run it, made only to be sent). True:
        decided here (made together, or served: on the main process, the command was sent);
        False: no rendezvous is pending, the caller's own check decides."""
        if self.replaying:
            return True
        if self.info.is_main:
            if self.serving:
                self._send(command())
                return True
            if not self.armed:
                return False
            self.armed = False
            alone = self._others_elsewhere(event)
            default_store().set(f"{_KEY}/{self.barriers}", "serve" if alone else "together")
            if alone:
                self.serving = True
                self._send(command())
            else:
                self.journal.clear()
            return True
        if not self.armed:
            return False
        self.armed = False
        if self._word(event) == "serve":
            self._serve()
            return False  # after the service, this call is this process's own
        return True

    def record(self, ema: Any, method: str, params: list[torch.Tensor]) -> None:
        """An EMA `store` / `copy_to` / `restore` on `params` (`weights.ema.journal_calls`):
        kept on the main process between a barrier and its decision, or while served."""
        if not self.info.is_main or not (self.armed or self.serving) or not params:
            return
        which = [i for i, p in enumerate(self.emas()) if p.ema is ema]
        model = [j for j, m in enumerate(self.models())
                 if next(iter(self.unwrap(m).parameters()), None) is params[0]]
        if which and model:
            self.journal.append((which[0], method, model[0]))

    def forward_command(self, module: nn.Module, args: Any, kwargs: Any,
                        kind: str = "forward") -> tuple[Any, ...]:
        """What the others run for the main process's forward or generate (`kind`) of `module` (a
        prepared model): its inputs, its modules' modes and, for a generate, its random state."""
        cpu = _moved((args, kwargs), lambda t: t.detach().cpu())
        modes = [m.training for m in module.modules()]
        rng = _rng_state(self.info.device) if kind == "generate" else None
        return (kind, self.index(module), cpu, modes, rng)  # (a prepared model: `index` is known)

    @staticmethod
    def sharded(module: nn.Module) -> bool:
        """Some parameter of `module` (a prepared model) is held in part by each process, so a
        forward of it is a collective (FSDP2's or DeepSpeed ZeRO-3's)."""
        return holds_shards(module)

    def index(self, module: nn.Module) -> int | None:
        """`module`'s place among the prepared models (None: not one of them, e.g. after
        `free_memory`)."""
        return next((i for i, m in enumerate(self.models()) if m is module), None)

    # -- the store and the channel ------------------------------------------------------------
    def _word(self, event: str) -> str:
        """Another process: post `event` and wait for the main process's word."""
        store, key = default_store(), f"{_KEY}/{self.barriers}"
        store.set(f"{key}/{self.info.rank}", event)
        self._wait_for([key], lambda _: (
            f"{event}: waited {self.wait_s:.0f} s after wait_for_everyone() for the main process to "
            "reach a call of the model or a collective (collective_timeout_s)"))
        return store.get(key).decode()

    def _others_elsewhere(self, event: str) -> bool:
        """The main process at a call it may make alone: whether some other process is at
        another event (so the call is the main process's alone)."""
        keys = [f"{_KEY}/{self.barriers}/{r}" for r in range(1, self.info.world_size)]
        self._wait_for(keys, lambda late: (
            f"{event} on the main process: process(es) {', '.join(k.rsplit('/', 1)[1] for k in late)} "
            f"reached no call of the model or collective within {self.wait_s:.0f} s after "
            "wait_for_everyone() (collective_timeout_s)"))
        store = default_store()
        return any(store.get(k).decode() != event for k in keys)

    def _wait_for(self, keys: list[str], refusal: Callable[[list[str]], str]) -> None:
        """Until every key is in the store; after `wait_s`, one line (`refusal(missing keys)`)."""
        store, start = default_store(), time.monotonic()
        while not store.check(keys):
            if time.monotonic() - start > self.wait_s:
                raise RuntimeError(refusal([k for k in keys if not store.check([k])]))
            time.sleep(_POLL_S)

    def _send(self, command: tuple[Any, ...]) -> None:
        """The main process: the EMA calls since the last command, then `command`, to the others."""
        box: list[Any] = [(list(self.journal), command)]
        self.journal.clear()
        dist.broadcast_object_list(box, src=0, group=self._group)
        if command[0] != "done":
            self._calls[command[0]] = self._calls.get(command[0], 0) + 1

    def _counts(self) -> str:
        names = {"generate": "generate(s)", "forward": "no-grad forward(s)",
                 "gather": "save_pretrained gather(s)"}
        return " and ".join(f"{self._calls[k]} {name}" for k, name in names.items() if self._calls.get(k))

    def _serve(self) -> None:
        """Another process: run the main process's calls until it says "done"."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self._group)
            journal, command = box[0]
            self.replaying = True
            try:
                self._replay(journal)
                if command[0] == "done":
                    return
                self._run(command)
            finally:
                self.replaying = False

    def _replay(self, journal: list[tuple[int, str, int]]) -> None:
        emas, models = self.emas(), self.models()
        for which, method, model in journal:
            getattr(emas[which].ema, method)(list(self.unwrap(models[model]).parameters()))

    def _run(self, command: tuple[Any, ...]) -> None:
        model = self.models()[command[1]]
        if command[0] == "gather":
            self.gather(model)
            return
        kind, _, (args, kwargs), modes, rng = command
        device = self.info.device
        args, kwargs = _moved((args, kwargs), lambda t: t.to(device))
        modules = list(model.modules())
        before = [m.training for m in modules]
        for m, mode in zip(modules, modes):
            m.training = mode
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                if kind == "generate":
                    _set_rng_state(rng, device)  # the main process's: the same samples, as many forwards
                    cast(Callable[..., Any], self.unwrap(model).generate)(*args, **kwargs)
                else:
                    model(*args, **kwargs)
        finally:
            for m, mode in zip(modules, before):
                m.training = mode


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, on a GPU, the device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, gpu = state
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu, device)


def _moved(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor inside dicts, lists and tuples; anything else as it is."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: _moved(v, fn) for k, v in data.items()})
    if type(data) in (list, tuple):
        return type(data)(_moved(v, fn) for v in data)
    return data
