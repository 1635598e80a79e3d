"""The planner's storage counter: live tensor bytes as an allocator would see them, by role and
by segment of the training step (`trace.py` drives it through real training steps).

  * every storage an operator returns is seen once (views share their base's storage), and its
    size is re-read after in-place ops and `UntypedStorage.resize_` (FSDP2 frees and re-allocates
    unsharded parameters that way);
  * a storage stops counting when its last reference dies (a weak reference on the storage).

The counter writes an event log (a storage's new size, or a mark that starts segments); roles
are given to storages as the run goes (`claim`, first by precedence in `ROLES`) and the log is
replayed once they are all known (`replay`).

**Two batch sizes from two steps.** A steady-state step starts with the optimizer state and the
previous step's outputs alive (a loop that writes `out = model(...)` frees them only when the
new outputs exist). The run takes two steps, A at batch b1 and B at b2, and reads each as a
steady-state step (`step_views`): A counts the optimizer state it creates from its start, and a
virtual copy of what it leaves to the next step (its outputs and batch) until its own batch and
outputs replace them; B counts what A left, scaled by b2/b1 (it is batch-sized). Checked against
plain three-step traces and against real 2-process runs (tests/test_plan.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from ..distributed.internals import local_tensor
from .fakes import DispatchMode, is_fake, overload_packet, process_group_ranks, storage_key, tree_leaves

ROLES = ("params", "grads", "optimizer", "comm", "activations", "temporaries")
_PRECEDENCE = {r: i for i, r in enumerate(ROLES)}
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_NOT_MOVING = ("wait_tensor",)  # a functional collective's wait: its bytes moved in the collective


@dataclass(frozen=True, slots=True)
class SegmentPeak:
    """The largest live bytes seen in one segment, with the role breakdown at that moment, and
    the live bytes by role after every event of the segment (`trajectory`, events x ROLES): the
    same operations run at every batch size, so event i of two traces is the same moment, and
    the fit extrapolates each moment before taking the peak (the moment of the peak can move)."""

    total: float
    roles: dict[str, float]
    trajectory: Any = None  # numpy array (events x len(ROLES)), or None



@functools.cache
def _flop_registry() -> dict[Any, Callable[..., int]]:
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry)


def _custom_flops(func: Any, args: Any) -> float:
    """FLOPs of transformers' grouped-matmul fallback (its experts at ep 1 in a trace, see
    `fakes.even_routing`), which torch's formulas do not know: input (S, in) x experts (E, in,
    out), 2 S in out forward, twice that for the input and weight gradients."""
    if func.namespace != "transformers" or not func.__name__.startswith("grouped_mm_fallback"):
        return 0.0
    x, w = args[0], args[1]
    return float((4 if "backward" in func.__name__ else 2) * x.shape[0] * x.shape[-1] * w.shape[-1])


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


def _full_buffer(op: str, args: Any, tensors: list[torch.Tensor]) -> float:
    """Bytes of a collective's full buffer: the biggest tensor it takes (an all-reduced tensor, a
    flat all-gather's output, a flat reduce-scatter's input), except for the list forms, whose
    buffer is their list of parts (all-gather's outputs, reduce-scatter's inputs: `args[0]`,
    `args[1]`, each a list of one list of parts)."""
    parts = args[0] if op == "allgather" else args[1] if op == "reduce_scatter" else None
    if parts is not None:
        return float(sum(_local(t).numel() * _local(t).element_size() for t in tree_leaves(parts)))
    return float(max(_local(t).numel() * _local(t).element_size() for t in tensors))


def _group_suffix(args: Any) -> str:
    """The key suffix of a collective's group (`fit.comm_factor` reads the ring's size from it):
    "" over the whole world; "@G" over a group of G consecutive ranks (a tensor-parallel group,
    a hybrid sharding group); "@G:S" over G ranks S apart (the data-parallel group under tensor
    parallelism, hybrid sharding's replicas)."""
    for a in args:
        ranks = process_group_ranks(a)
        if ranks is None:
            continue
        if len(ranks) >= dist.get_world_size():
            return ""
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        return f"@{len(ranks)}" + (f":{stride}" if stride != 1 else "")
    return ""


class StorageCounter(DispatchMode):
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
        self.host_copies: set[int] = set()  # serials of activations offloaded to the host
        self.phase = "setup"
        self.counting = False  # collectives are counted during the training steps only
        self.comm_bytes: dict[str, float] = {}
        self.count_flops = False
        self.flops = 0.0
        self._next = 0

    # storages
    def see_storage(self, st: torch.UntypedStorage) -> int:
        """The serial of a storage (new ones are logged at their size; resized ones re-logged)."""
        key = storage_key(st)
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
        """The serial of a tensor's storage (a DTensor's: its local shard's)."""
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
            nbytes = buf.numel() * buf.element_size()
            self.comm_bytes["allreduce"] = self.comm_bytes.get("allreduce", 0.0) + nbytes

    def mark(self, *keys: str) -> None:
        """From now on, live bytes count toward these segments."""
        self.log.append(("mark", keys))

    def claim(self, role: str, tensors: Any) -> None:
        """Give these tensors' storages `role`, unless they hold one of higher precedence."""
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            s = self.see(t)
            if _PRECEDENCE[role] < _PRECEDENCE.get(self.role.get(s, "temporaries"), 99):
                self.role[s] = role

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.nonzero.default and is_fake(args[0]):
            # A fake tensor has no data: take the largest result (every element nonzero), which
            # is also what the usual uses (label masks, all valid) produce. (A real one, such as
            # a device mesh's coordinates, is answered for real.)
            x = args[0]
            out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            self.see(out)
            return out
        out = func(*args, **(kwargs or {}))
        if self.count_flops:
            # FlopCounterMode's formulas, without its module hooks (they keep tensors alive)
            count = _flop_registry().get(overload_packet(func))
            if count is not None:
                self.flops += count(*args, **(kwargs or {}), out_val=out)
            else:
                self.flops += _custom_flops(func, args)
        if func.namespace in _COMM_NAMESPACES:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.claim("comm", tensors)
            op = func.__name__.split(".")[0].strip("_")
            if self.counting and tensors and op not in _NOT_MOVING:
                # c10d's "allreduce_" and the functional "all_reduce" (DTensor's) are one kind
                name = op.replace("all_reduce", "allreduce") + _group_suffix(args)
                self.comm_bytes[name] = self.comm_bytes.get(name, 0.0) + _full_buffer(op, args, tensors)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out



Event = tuple[int, int] | tuple[str, tuple[str, ...]]


Peaks = tuple[dict[str, SegmentPeak], dict[str, SegmentPeak], dict[str, float]]


def replay(
    events: list[Event],
    window: tuple[int, int],
    role_of: Callable[[int], str],
    host_of: Callable[[int], bool],
) -> Peaks:
    """Per segment: the peak of all live bytes, of device bytes (with role breakdowns), of host
    bytes, and the trajectories (see `SegmentPeak`). Bytes count from the first event; segments
    only for marks inside `window`. Live bytes by role are recorded once per event, each
    segment keeping the indices of its events; peaks are taken over those at the end."""
    import numpy as np

    snaps, members = _snapshots(events, window, role_of, host_of)
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


def _snapshots(
    events: list[Event],
    window: tuple[int, int],
    role_of: Callable[[int], str],
    host_of: Callable[[int], bool],
) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Live bytes after every event inside a segment: by role (all, then device only), then
    host; and per segment the indices of its snapshots."""
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
    return snaps, members


def _sizes_at(events: list[Event], end: int) -> dict[int, int]:
    size: dict[int, int] = {}
    for entry in events[:end]:
        if entry[0] != "mark":
            size[entry[0]] = entry[1]  # type: ignore[index,assignment]
    return size


@dataclass(frozen=True, slots=True)
class StepMarks:
    """Log positions of the two traced steps (A at batch b1, then B at batch b2)."""

    a0: int  # A starts (before its batch exists)
    a_batch: int  # A's batch exists (the previous batch would be gone)
    a_fwd: int  # A's first forward returned (the previous outputs would be gone)
    b0: int  # B starts
    end: int


StepView = tuple[list[Event], tuple[int, int]]  # a step's log and the window of its own events


def step_views(counter: StorageCounter, st: StepMarks, scale: float) -> list[StepView]:
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



def resize_seen(counter: StorageCounter) -> Callable[..., Any]:
    """`UntypedStorage.resize_` that tells the counter the storage's new size."""
    original = torch.UntypedStorage.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        result = original(self, size)
        counter.see_storage(self)
        return result

    return resize_

