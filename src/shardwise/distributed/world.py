"""Process group and device from the launcher's environment. The only module that reads it.

torchrun (and `shardwise launch`, which is torchrun) sets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Without them the run is a world of size one,
which still gets a real (single-member) process group so every strategy runs unchanged.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .internals import member_groups


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from None


def _pick_device(local_rank: int, force_cpu: bool) -> torch.device:
    if force_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node has only {count} GPU(s): start at most one "
            "process per GPU (--nproc-per-node), or pass cpu=True to run on CPU processes"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


NCCL_BACKSTOP_S = 60.0  # on a GPU, the group's timeout: collective_timeout_s and this


def init_distributed(*, force_cpu: bool, timeout_s: float | None = None) -> DistInfo:
    """Join (or create) the default process group described by the launcher's environment.

    CUDA devices get NCCL for device tensors and gloo for host tensors (optimizer offload keeps
    a few host-side collectives); CPU-only runs use gloo. An already initialised default group
    is reused, so several Engines can live in one process.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    device = _pick_device(local_rank, force_cpu)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and timeout_s is not None:
        timeout_s += NCCL_BACKSTOP_S  # the hang watch (runtime.hang) speaks first, NCCL's watchdog after
    # a collective not done within the timeout raises (gloo) or aborts the process (NCCL)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    _TIMEOUT[0] = timeout
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if device.type not in backends_of():
            raise RuntimeError(
                f"the process group made before the Engine runs on backend {dist.get_backend()!r}, "
                f"which takes no {device.type} tensors: make it with a {device.type} backend "
                "(e.g. init_process_group(\"cpu:gloo,cuda:nccl\")), or leave it to the Engine")
    elif world_size == 1 and "MASTER_ADDR" not in os.environ:
        # No launcher: a private in-memory store, no port to pick or collide on.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, store=_join_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout)
    return DistInfo(rank, world_size, local_rank, local_world_size, device)


_TIMEOUT: list[datetime.timedelta | None] = [None]  # the collective timeout the default group was joined with


def backends_of(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """Which backend runs `group`'s collectives (the default group's: None) on tensors of each
    device type: {"cpu": "gloo", "cuda": "nccl"} for the engine's own `"cpu:gloo,cuda:nccl"`.
    The one place that reads a group's backend: `dist.get_backend` returns the whole string
    for a group made per device, so a comparison with "nccl" or "gloo" is never true there.
    A device type missing from the answer is one the group's collectives refuse: a pure "nccl"
    group (a torchrun script's own `init_process_group("nccl")`) takes CUDA tensors only."""
    return parse_backend(str(dist.get_backend(group)))


def parse_backend(backend: str) -> dict[str, str]:
    """A backend string read per device type (see `backends_of`): `"cpu:gloo,cuda:nccl"` as
    written; one name alone ("gloo", "nccl") for every device type torch says it takes."""
    text = backend.strip().lower()
    if ":" in text:
        pairs = (part.split(":", 1) for part in text.split(",") if part.strip())
        return {device.strip(): name.strip() for device, name in pairs}
    return dict.fromkeys(dist.Backend.backend_capability.get(text, ()), text)


def host_device(device: torch.device | None, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the engine's host-side collectives on `group` put their tensors (the run's
    `device` otherwise): the CPU when the group has a CPU backend (gloo, alone or beside NCCL),
    else the run's device. Those collectives are small (agreed counts and flags, RNG states)
    or one tensor at a time (weights agreed before sharding), so on a pure-NCCL default group a
    script made itself they are moved to the device rather than sent on a gloo group of the
    engine's own: a new group is a collective every process must reach in the same order, with
    a rendezvous of its own, and NCCL's device is the run's. A CPU run on a group without a CPU
    backend is refused where the group is joined (`init_distributed`). `device` None: the
    current CUDA device (the one `init_distributed` set, NCCL's). No process group: the CPU
    (there is nothing to send)."""
    if not dist.is_initialized() or "cpu" in backends_of(group):
        return torch.device("cpu")
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


def new_background_group() -> dist.ProcessGroup:
    """A gloo group of every process, for the collectives of a checkpoint written in a background
    thread (`checkpoint_async`): on the training's own group they would interleave with the
    training's collectives, which the main thread issues meanwhile, in an order no other process
    shares. A collective: call it on the main thread at a point every process reaches (a
    `CheckpointManager` makes its own at its first asynchronous save, so two engines' writers
    never share one). Same timeout as the default group."""
    made = dist.new_group(backend="gloo", timeout=_TIMEOUT[0])
    assert isinstance(made, dist.ProcessGroup)  # every process is a member
    return made


def leave_process_groups() -> None:
    """Every process, at the end of training: a last barrier on each gloo group, then every group
    goes.

    gloo runs a group's collectives on threads of its own. The thread that ran one drops its
    reference a moment after `wait` returned, and when that is the last one the collective's
    tensors are freed there; freeing a tensor whose Python object is gone takes the GIL. A thread
    still descheduled when the interpreter begins to finalize gets the GIL only to be ended inside
    C++, and the process aborts ("terminate called without an active exception", SIGABRT) after a
    run that had finished. A barrier holds the collectives still in flight when it was issued
    (weakly: they are freed with it), and `_FINAL_BARRIERS` holds the barriers to the end of the
    process, so everything gloo's threads ran last is freed by this thread, at the interpreter's
    own teardown, never by theirs."""
    if not dist.is_initialized():
        return
    handles = [dist.barrier(group=group, async_op=True) for group in _gloo_groups()]
    for handle in handles:
        handle.wait()
    _FINAL_BARRIERS.extend(handles)
    dist.destroy_process_group()


_FINAL_BARRIERS: list[dist.Work] = []  # kept to the end of the process (see leave_process_groups)


def _gloo_groups() -> list[dist.ProcessGroup]:
    """Every group this process belongs to whose collectives all run on gloo (the default group
    first); the default group alone when its device collectives are NCCL's."""
    groups = member_groups()
    default = dist.group.WORLD
    gloo = [g for g in groups if g is not default and set(backends_of(g).values()) == {"gloo"}]
    return [default, *gloo] if default is not None else gloo


def _join_store(rank: int, world_size: int, timeout: datetime.timedelta | None) -> dist.Store:
    """The launcher's TCP store (MASTER_ADDR:MASTER_PORT) under keys of this join's own.

    A store keeps every key a process group wrote: gloo's rendezvous leaves each process's
    address there. Two joins that share keys can read each other's, and a process that reads
    its peer's old address before the peer overwrote it connects to a dead port and waits out
    the timeout. That happens when torchrun restarts the worker group (its agent's store
    outlives the failed attempt) and when one process ends an Engine and starts another (one
    rank joins again while the other still leaves). So each restart attempt and each join
    within a process gets a prefix of its own. The store itself is made once per process and
    kept (`_STORE`): rank 0, where it is not torchrun's agent that serves it, serves it, and a
    second server on the same port would race the first one's teardown for the peers'
    connections. Every process starts its Engines in the same order, so the join counts agree.
    """
    if not _STORE:
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        _STORE.append(dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
            is_master=rank == 0 and not agent_store, multi_tenant=True,
            timeout=timeout or dist.default_pg_timeout))
    joins = _JOINS[0]
    _JOINS[0] += 1
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    return dist.PrefixStore(f"/shardwise/attempt_{attempt}/join_{joins}", _STORE[0])


_STORE: list[dist.TCPStore] = []  # this process's one TCP store for every join (see _join_store)
_JOINS = [0]  # how many times this process has joined a process group (see _join_store)


def config_source(argv: list[str] | None = None) -> str | None:
    """The resolved config a launcher handed to this worker: SHARDWISE_CONFIG, else a
    `--config PATH` (or `--config=PATH`) among the script's own arguments."""
    import sys

    env = os.environ.get("SHARDWISE_CONFIG")
    if env:
        return env
    args = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None
