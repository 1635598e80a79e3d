"""Run real training steps of a model on fake tensors and record what every rank would hold.

Nothing is allocated and no device is needed: the model's parameters are `FakeTensor`s (shapes
and dtypes only), the process group is torch's "fake" backend of the planned world size, and the
model goes through our own `Engine.prepare` with the strategy under study, so DDP's buckets,
zero1's flat sharded optimizer, FSDP2's shards and all-gather buffers and both offload modes are
the real code paths. We then run the usual loop (forward, loss, backward, optimizer step,
zero_grad) and count live tensor storage the way an allocator would:

  * every storage an operator returns is seen once (views share their base's storage), and its
    size is re-read after in-place ops and `UntypedStorage.resize_` (FSDP2 frees and re-allocates
    unsharded parameters that way);
  * a storage stops counting when its last reference dies (a weak reference on the storage).

The per-rank figure is rank 0's (FSDP2 pads shards evenly; zero1's first ranks own the full
chunks). Fake tensors hold no data, so a data-dependent `nonzero` is taken at its largest (every
element nonzero: what label masks give). CPU processes need no emulation of gloo: FSDP2's
reduce-scatter runs there as an in-place all-reduce (`strategies/fsdp.py`), no transient copy.

**Two batch sizes from two steps.** A steady-state step starts with the optimizer state and the
previous step's outputs alive (a loop that writes `out = model(...)` frees them only when the
new outputs exist). The run takes two steps, A at batch b1 and B at b2, and reads each as a
steady-state step: A counts the optimizer state it creates from its start, and a virtual copy of
what it leaves to the next step (its outputs and batch) until its own batch and outputs replace
them; B counts what A left, scaled by b2/b1 (it is batch-sized). Checked against plain
three-step traces and against real 2-process runs (tests/test_plan.py).

**Segments.** The count is kept per segment of the step, so that a trace of a model cut to a few
layers can be extrapolated to its full depth (see `fit.py`): forward and backward are split at
the repeated blocks into `pre` (below the first block: embeddings), the blocks counted from each
end (`b0`, `b1` and `bL2`, `bL1`: second-to-last and last), and `post` (head and loss); the
optimizer step and zero_grad are segments of their own. Inside the stack every block behaves the
same except for how many layers of activations and gradients lie below or above it, so a
segment's peak is linear in the depth, and the interior blocks never exceed the peak of `b1` or
`bL2`.

**Roles.** After the run each storage gets one role, in this order of precedence: parameters
(model parameters and buffers, sharded or gathered), gradients (the `.grad` the optimizer reads),
optimizer (whatever the optimizer runner keeps: Adam moments, host masters and gradient buffers
of the offload runner), communication (the arguments of collectives: DDP buckets, FSDP2 all-gather
and reduce-scatter buffers, zero1's gather buffers), activations (anything else made in forward,
including the inputs and the previous step's outputs) and temporaries (anything else made in
backward or the optimizer step).

**Device and host.** This runs on CPU, where everything is host memory; a CUDA run keeps some of
it on the host, and the planner needs to know which part. By strategy: `offload="optimizer"`
keeps the optimizer role and the temporaries of the optimizer step on the host;
`offload="params"` (FSDP2's CPUOffloadPolicy) also keeps the parameter shards and gradient
shards there, while gathered parameters, activations and buffers are on the device. Not seen by
the trace on CPU: the device copies of parameter shards that FSDP2 makes before each all-gather
under parameter offload (one unit's shard at a time), and the workspaces of CUDA libraries.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..internals import local_tensor
from .fakes import fake_ddp, fake_world, kept_rng, patched

ROLES = ("params", "grads", "optimizer", "comm", "activations", "temporaries")
_PRECEDENCE = {r: i for i, r in enumerate(ROLES)}
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration the planner compares."""

    strategy: str
    offload: str = "none"
    activation_checkpointing: bool = False

    @property
    def name(self) -> str:
        off = {"none": "", "optimizer": " + offload optimizer", "params": " + offload params"}[self.offload]
        return f"{self.strategy}{off}{' + AC' if self.activation_checkpointing else ''}"


@dataclass(frozen=True, slots=True)
class SegmentPeak:
    """The largest live bytes seen in one segment, with the role breakdown at that moment, and
    the live bytes by role after every event of the segment (`trajectory`, events x ROLES): the
    same operations run at every batch size, so event i of two traces is the same moment, and
    the fit extrapolates each moment before taking the peak (the moment of the peak can move)."""

    total: float
    roles: dict[str, float]
    trajectory: Any = None  # numpy array (events x len(ROLES)), or None


@dataclass(frozen=True, slots=True)
class TraceResult:
    """What one traced configuration held on rank 0 during the second training step."""

    total: dict[str, SegmentPeak]  # host + device, the figure a CPU run holds
    device: dict[str, SegmentPeak]  # what a CUDA run keeps on the device
    host: dict[str, float]  # what a CUDA run keeps on the host, peak per segment
    comm_bytes: dict[str, float]  # bytes through each kind of collective in one step
    flops: float  # forward + backward (+ recompute) FLOPs of one step on rank 0
    offload_bytes: float  # host<->device copies one step needs under offload (per rank)
    host_optimizer_numel: float  # elements the host optimizer steps (offload), per rank
    parameters: float  # parameters of the traced (possibly cut) model


# -- the storage counter ------------------------------------------------------------------------
@functools.cache
def _flop_registry() -> dict[Any, Callable[..., int]]:
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


class _Counter(TorchDispatchMode):
    """Live storage bytes, as an event log replayed once roles are known (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._serial_of: dict[int, int] = {}  # StorageImpl address -> serial (while alive)
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._size: dict[int, int] = {}
        self.log: list[tuple[int, int] | tuple[str, tuple[str, ...]]] = []
        self.born: dict[int, str] = {}  # serial -> phase it was created in
        self.birth: dict[int, int] = {}  # serial -> log index of its creation
        self.role: dict[int, str] = {}
        self.sharded_params: set[int] = set()
        self.phase = "setup"
        self.counting = False  # collectives are counted during the training steps only
        self.comm_bytes: dict[str, float] = {}
        self.count_flops = False
        self.flops = 0.0
        self._next = 0

    # storages
    def see_storage(self, st: torch.UntypedStorage) -> int:
        key = st._cdata
        serial = self._serial_of.get(key)
        n = st.nbytes()
        if serial is None:
            serial = self._next
            self._next += 1
            self._serial_of[key] = serial
            self.born[serial] = self.phase
            self.birth[serial] = len(self.log)
            self._refs[serial] = weakref.ref(st, functools.partial(self._gone, key, serial))
            self._set(serial, n)
        elif self._size[serial] != n:
            self._set(serial, n)
        return serial

    def see(self, t: torch.Tensor) -> int:
        return self.see_storage(_local(t).untyped_storage())

    def _gone(self, key: int, serial: int, _ref: Any) -> None:
        if self._serial_of.get(key) == serial:
            del self._serial_of[key]
        self._refs.pop(serial, None)
        self._set(serial, 0)

    def _set(self, serial: int, n: int) -> None:
        self._size[serial] = n
        self.log.append((serial, n))

    def on_bucket(self, buf: torch.Tensor) -> None:
        """DDP all-reduces this bucket (see `fakes.fake_ddp`)."""
        self.claim("comm", [buf])
        if self.counting:
            self.comm_bytes["allreduce"] = self.comm_bytes.get("allreduce", 0.0) + buf.numel() * buf.element_size()

    def mark(self, *keys: str) -> None:
        """From now on, live bytes count toward these segments."""
        self.log.append(("mark", keys))

    def claim(self, role: str, tensors: Any) -> None:
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            s = self.see(t)
            if _PRECEDENCE[role] < _PRECEDENCE.get(self.role.get(s, "temporaries"), 99):
                self.role[s] = role

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.nonzero.default:
            # A fake tensor has no data: take the largest result (every element nonzero), which
            # is also what the usual uses (label masks, all valid) produce.
            x = args[0]
            out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            self.see(out)
            return out
        out = func(*args, **(kwargs or {}))
        if self.count_flops:
            # FlopCounterMode's formulas, without its module hooks (they keep tensors alive)
            count = _flop_registry().get(func._overloadpacket)
            if count is not None:
                self.flops += count(*args, **(kwargs or {}), out_val=out)
        if func.namespace in _COMM_NAMESPACES:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.claim("comm", tensors)
            if self.counting and tensors:
                name = func.__name__.split(".")[0].strip("_")
                biggest = max(_local(t).numel() * _local(t).element_size() for t in tensors)
                self.comm_bytes[name] = self.comm_bytes.get(name, 0.0) + biggest
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out


Event = tuple[int, int] | tuple[str, tuple[str, ...]]


def _replay(
    events: list[Event], window: tuple[int, int], role_of: Callable[[int], str], host_of: Callable[[int], bool]
) -> tuple[dict[str, SegmentPeak], dict[str, SegmentPeak], dict[str, float]]:
    """Per segment: the peak of all live bytes, of device bytes (with role breakdowns), of host
    bytes, and the trajectories (see `SegmentPeak`). Bytes count from the first event; segments
    only for marks inside `window`. Live bytes by role are recorded once per event, each
    segment keeping the indices of its events; peaks are taken over those at the end."""
    import numpy as np

    size: dict[int, int] = {}
    roles = dict.fromkeys(ROLES, 0)
    dev_roles = dict.fromkeys(ROLES, 0)
    host = 0
    keys: tuple[str, ...] = ()
    snaps: list[list[int]] = []  # roles (all live bytes), then roles (device bytes), then host
    members: dict[str, list[int]] = {}  # segment -> indices into snaps
    for i, entry in enumerate(events):
        if entry[0] == "mark":
            keys = entry[1] if window[0] <= i < window[1] else ()
            continue
        serial, n = cast(tuple[int, int], entry)
        delta = n - size.get(serial, 0)
        size[serial] = n
        r = role_of(serial)
        roles[r] += delta
        if host_of(serial):
            host += delta
        else:
            dev_roles[r] += delta
        if not keys:
            continue
        snaps.append([*roles.values(), *dev_roles.values(), host])
        for k in keys:
            members.setdefault(k, []).append(len(snaps) - 1)
    best_total: dict[str, SegmentPeak] = {}
    best_dev: dict[str, SegmentPeak] = {}
    best_host: dict[str, float] = {}
    if not snaps:
        return best_total, best_dev, best_host
    table = np.asarray(snaps, dtype=np.float64)
    nr = len(ROLES)
    for k, idx in members.items():
        rows = table[np.asarray(idx)]
        tot, dev = rows[:, :nr], rows[:, nr : 2 * nr]
        t, d = tot.sum(axis=1), tot.sum(axis=1) - rows[:, 2 * nr]
        i_t, i_d = int(t.argmax()), int(d.argmax())
        best_total[k] = SegmentPeak(float(t[i_t]), {x: float(tot[i_t, j]) for j, x in enumerate(ROLES)}, tot)
        best_dev[k] = SegmentPeak(float(d[i_d]), {x: float(dev[i_d, j]) for j, x in enumerate(ROLES)}, dev)
        best_host[k] = float(rows[:, 2 * nr].max())
    return best_total, best_dev, best_host


def _sizes_at(events: list[Event], end: int) -> dict[int, int]:
    size: dict[int, int] = {}
    for entry in events[:end]:
        if entry[0] != "mark":
            size[entry[0]] = entry[1]  # type: ignore[index,assignment]
    return size


@dataclass(frozen=True, slots=True)
class _Steps:
    """Log positions of the two traced steps (A at batch b1, then B at batch b2)."""

    a0: int  # A starts (before its batch exists)
    a_batch: int  # A's batch exists (the previous batch would be gone)
    a_fwd: int  # A's first forward returned (the previous outputs would be gone)
    b0: int  # B starts
    end: int


def _step_views(counter: _Counter, st: _Steps, scale: float) -> list[tuple[list[Event], tuple[int, int]]]:
    """Each step's log as if it were a steady-state step.

    Step A is the first step: the optimizer state it creates is counted from its start, and a
    virtual copy of its own outputs and batch plays the previous step's (until A's batch exists
    and its forward has returned, as in a loop that rebinds `batch` and `out`). Step B follows A
    at `scale` times A's batch: A's outputs and batch, still alive during B's start, are counted
    `scale` times (they are batch-sized). So one run of two steps measures two batch sizes.
    """
    log = counter.log
    at_b0 = _sizes_at(log, st.b0)  # A's end
    born = counter.birth
    in_a = [s for s, i in born.items() if st.a0 <= i < st.b0]
    state = {s for s in in_a if counter.born[s] == "opt" and at_b0.get(s, 0) > 0}
    # everything else a step leaves to the next belongs to its outputs (with activation
    # checkpointing, a transformers cache can grow during the recompute in backward)
    prev = {s for s in in_a if counter.born[s] != "opt" and at_b0.get(s, 0) > 0}
    view_a: list[Event] = list(log[: st.a0])
    view_a += [(s, at_b0[s]) for s in sorted(state)]
    view_a += [(-s - 1, at_b0[s]) for s in sorted(prev)]  # virtual previous step
    start_a = len(view_a)
    for i in range(st.a0, st.b0):
        if i == st.a_batch:
            view_a += [(-s - 1, 0) for s in sorted(prev) if counter.born[s] == "batch"]
        if i == st.a_fwd:
            view_a += [(-s - 1, 0) for s in sorted(prev) if counter.born[s] != "batch"]
        entry = log[i]
        if entry[0] != "mark" and entry[0] in state:
            continue  # already counted from the start
        view_a.append(entry)
    view_b: list[Event] = list(log[: st.b0])
    view_b += [(s, int(at_b0[s] * scale)) for s in sorted(prev)]
    start_b = len(view_b)
    for entry in log[st.b0 : st.end]:
        if entry[0] != "mark" and entry[0] in prev:
            entry = (entry[0], int(entry[1] * scale))
        view_b.append(entry)
    return [(view_a, (start_a, len(view_a))), (view_b, (start_b, len(view_b)))]


# -- hooks that mark segments -------------------------------------------------------------------
def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _positions(j: int, depth: int) -> tuple[str, ...]:
    keys = []
    if j == 0:
        keys.append("b0")
    if j == 1:
        keys.append("b1")
    if j == depth - 2:
        keys.append("bL2")
    if j == depth - 1:
        keys.append("bL1")
    return tuple(keys)


def _hook_blocks(blocks: list[nn.Module], counter: _Counter, model: nn.Module) -> list[Any]:
    depth = len(blocks)
    handles = []
    for j, block in enumerate(blocks):
        pos = _positions(j, depth)

        def pre(mod: nn.Module, args: Any, kwargs: Any, _j: int = j, _pos: tuple[str, ...] = pos) -> None:
            if counter.phase != "fwd" or not torch.is_grad_enabled():
                return
            counter.mark(*(f"fwd.{p}" for p in _pos))
            if _j == 0:
                counter.claim("params", model.parameters())  # the root unit's gathered parameters
                x = _first_grad_tensor((args, kwargs))
                if x is not None:
                    x.register_hook(lambda g: counter.mark("bwd.pre"))
            counter.claim("params", mod.parameters())  # gathered by FSDP2's pre-forward hook

        def post(mod: nn.Module, args: Any, kwargs: Any, out: Any, _j: int = j, _pos: tuple[str, ...] = pos) -> None:
            if counter.phase != "fwd" or not torch.is_grad_enabled():
                return
            if _j == depth - 1:
                counter.mark("fwd.post")
            y = _first_grad_tensor(out)
            if y is not None:
                y.register_hook(lambda g: counter.mark(*(f"bwd.{p}" for p in _pos)))

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    return handles


# -- one traced configuration -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceJob:
    """Everything one trace needs; `build` makes the (fake) model inside the fake mode."""

    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]  # per-device batch size -> a batch as the loader yields it
    loss_fn: Callable[[Any, Any], torch.Tensor]  # (model output, batch) -> loss
    candidate: Candidate
    world_size: int
    batches: tuple[int, int]  # the two per-device batch sizes measured (b1 < b2)
    precision: str = "fp32"
    foreach: bool | None = None  # the optimizer's foreach (what CUDA defaults to: True)
    grad_accum_steps: int = 1
    wrap: tuple[Any, ...] = ()
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    count_flops: bool = False


def run_trace(job: TraceJob) -> dict[int, TraceResult]:
    """Prepare the model with the candidate's strategy on fake ranks and trace two steps, one
    at each batch size of `job.batches` (see `_step_views`); the result per batch size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.parallel import distributed as ddp_module

    from ..config import make_config
    from ..dist import init_distributed
    from ..session import Session
    from ..strategies import find_blocks, make_strategy

    cand = job.candidate
    trace_precision = "bf16" if job.precision == "fp16" else job.precision  # same bytes, no loss scaler
    cfg = make_config(strategy=cand.strategy, offload=cand.offload, precision=trace_precision, cpu=True,
                      activation_checkpointing=cand.activation_checkpointing, wrap=tuple(job.wrap),
                      grad_accum_steps=job.grad_accum_steps)
    counter = _Counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(kept_rng())
        stack.enter_context(fake_world(job.world_size))
        # the session that `Engine.prepare` builds, on the fake ranks (made outside the fake mode)
        session = Session(cfg, make_strategy(cfg, init_distributed(force_cpu=True)))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(patched(torch.UntypedStorage, "resize_", _resize_seen(counter)))
        # DDP compares parameter shapes across ranks by reading tensor data; fake ranks agree.
        stack.enter_context(patched(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None))
        model = job.build()
        # The fake parameters are already where they belong; moving them would try to swap them.
        model.to = lambda *a, **k: model  # type: ignore[method-assign]
        blocks = find_blocks(model, job.wrap)
        make_opt = job.optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=job.foreach))
        stack.enter_context(counter)
        counter.claim("params", list(model.parameters()) + list(model.buffers()))
        n_full = sum(p.numel() for p in model.parameters())
        optimizer = make_opt(model.parameters())
        prepared = session.prepare([model], [optimizer], [])
        model, optimizer = prepared[id(model)], prepared[id(optimizer)]
        fake_ddp(model, counter.on_bucket)
        sharded = list(model.parameters())
        counter.claim("params", sharded + list(model.buffers()))
        sharded_ids = {counter.see(p) for p in sharded}
        runner = optimizer.runner
        counter.claim("optimizer", runner.tensors())
        handles = _hook_blocks(blocks, counter, model)
        out: Any = None
        marks: dict[str, int] = {}
        comm: list[dict[str, float]] = []
        flops: list[float] = []
        for step, batch_size in enumerate(job.batches):
            marks[f"start{step}"] = len(counter.log)
            counter.comm_bytes, counter.counting = {}, True  # this step's collectives
            for _micro in range(job.grad_accum_steps):
                counter.phase = "batch"
                batch = job.make_batch(batch_size)
                counter.claim("activations", [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)])
                marks.setdefault(f"batch{step}", len(counter.log))
                counter.phase = "fwd"
                counter.mark("fwd.pre")
                counter.flops, counter.count_flops = 0.0, job.count_flops  # one micro-step's FLOPs
                with session.accumulate([model], loader_at_end=False):
                    out = _forward(model, batch)  # the previous outputs live until this returns
                    marks.setdefault(f"fwd{step}", len(counter.log))
                    loss = job.loss_fn(out, batch)
                    counter.phase = "bwd"
                    counter.mark("bwd.post")
                    session.backward(loss)
                counter.count_flops = False
                counter.claim("grads", [p.grad for p in model.parameters()])
                counter.phase = "opt"
                counter.mark("opt")
                optimizer.step()
                counter.claim("optimizer", runner.tensors())
                counter.claim("grads", [p.grad for p in model.parameters()])
                counter.phase = "zero"
                counter.mark("zero")
                optimizer.zero_grad()
                counter.mark()
                del loss
            comm.append(dict(counter.comm_bytes))
            flops.append(counter.flops)
        marks["end"] = len(counter.log)
        for h in handles:
            h.remove()
    host_roles = _host_roles(cand)

    def source(serial: int) -> int:
        return -serial - 1 if serial < 0 else serial

    def role_of(serial: int) -> str:
        s = source(serial)
        r = counter.role.get(s)
        if r is not None:
            return r
        return "activations" if counter.born.get(s) in ("fwd", "batch") else "temporaries"

    def host_of(serial: int) -> bool:
        if cand.offload == "none":
            return False
        s = source(serial)
        role = counter.role.get(s)
        if role is None and counter.born.get(s) == "opt":
            return True  # the host optimizer step's temporaries
        if role == "params":
            return "params" in host_roles and s in sharded_ids
        return role in host_roles

    steps = _Steps(marks["start0"], marks["batch0"], marks["fwd0"], marks["start1"], marks["end"])
    b1, b2 = job.batches
    views = _step_views(counter, steps, b2 / b1)
    n_params = sum(_local(p).numel() for p in sharded)
    param_bytes = sum(_local(p).numel() * _local(p).element_size() for p in sharded)
    offload_bytes = 0.0
    if cand.offload == "optimizer":
        offload_bytes = 2.0 * param_bytes  # gradient shards to the host, updated shards back
    elif cand.offload == "params":
        # shards go up for every all-gather (forward, and backward under zero3), grads come down
        offload_bytes = 3.0 * param_bytes
    results = {}
    for i, (view, window) in enumerate(views):
        total, device, host = _replay(view, window, role_of, host_of)
        results[job.batches[i]] = TraceResult(
            total=total, device=device, host=host, comm_bytes=comm[i], flops=flops[i],
            offload_bytes=offload_bytes, host_optimizer_numel=float(n_params) if cand.offload != "none" else 0.0,
            parameters=float(n_full),
        )
    return results


def _host_roles(cand: Candidate) -> set[str]:
    if cand.offload == "optimizer":
        return {"optimizer"}
    if cand.offload == "params":
        return {"optimizer", "grads", "params"}
    return set()


def _resize_seen(counter: _Counter) -> Callable[..., Any]:
    original = torch.UntypedStorage.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        result = original(self, size)
        counter.see_storage(self)
        return result

    return resize_


def _forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def default_loss(out: Any, batch: Any) -> torch.Tensor:
    """The model's own loss (`transformers` models given labels), else the mean of its output."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is not None:
        return cast(torch.Tensor, loss)
    t = out if isinstance(out, torch.Tensor) else _first_grad_tensor(out)
    if t is None:
        raise TypeError(f"cannot find a loss in the model's output ({type(out).__name__}); pass loss_fn")
    return t.float().mean()
