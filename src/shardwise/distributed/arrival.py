"""Telling whether every process makes a call, or the main process makes it alone.

Scripts written for Accelerate (diffusers' `train_unconditional.py`) call `save_state()` and
sample with the model inside `if accelerator.is_main_process:`. The other processes are then
already in the next step's all-reduce, so any collective in the call waits for them forever.
Telling "only the main process called" needs no collective: every process that enters the
call adds 1 to a key of the process group's store (a TCP round trip, no tensor traffic) and
polls until the count reaches the world size. The main process decides it is alone when every
other process has gone past this point: their heartbeats in the store (`resilience.Supervisor`: one
per boundary, forward, backward and `wait_for_everyone`, the same sequence on every process)
outnumber its own; or, without that sign, after `ARRIVAL_TIMEOUT_S`. It then closes the key by
adding `_CLOSED` and goes on alone (ddp) or refuses (sharded). A process that is merely late
(busy before a call everyone makes) has fewer heartbeats, so the main process waits for it. The
keys are numbered by the optimizer step and a per-step call count, so processes
that make the same calls at the same steps use the same key without agreeing on anything; a
process that finds its key closed knows the main process made a call alone there, and takes
the next key. (Limit: when the main process reaches a call everyone makes more than
`ARRIVAL_TIMEOUT_S` before the others, it counts as alone; the others then wait at the next key
until the collective timeout and raise.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch.distributed as dist

from .internals import default_store

ARRIVAL_TIMEOUT_S = 60.0  # with no sign that the others moved on: how long until the main process is alone
_LOOK_EVERY_S = 0.1  # how often the waiting main process reads the others' heartbeats
_CLOSED = 1 << 30  # added to a key by the process that stopped waiting


def arrived_together(calls: dict[int, int], kind: str, step: int, world: int, is_main: bool,
                     wait_s: float, moved_on: Callable[[], bool]) -> bool:
    """True when every process makes this call; False on the main process when the others
    moved on (`moved_on()`) or it waited `ARRIVAL_TIMEOUT_S` alone. The other processes never
    give up early (the main process may just be busy alone, logging or sampling, before a call
    everyone makes): they wait up to
    `wait_s` (the collective timeout) and then raise. `calls`: this kind's calls at `step`,
    which number the keys (updated)."""
    if world == 1 or not dist.is_initialized():
        return True
    store = default_store()
    n = calls.get(step, 0)
    start = time.monotonic()
    looked = start
    while True:
        key = f"shardwise/together/{kind}/{step}/{n}"
        count = store.add(key, 1)
        while count < world:
            now = time.monotonic()
            waited, look = now - start, is_main and now - looked > _LOOK_EVERY_S
            looked = now if look else looked
            if is_main and (waited > ARRIVAL_TIMEOUT_S or (look and moved_on())):
                # closing the key and reading the count is one atomic add: a process that
                # arrived meanwhile is counted here and saw `world` itself: both say "together"
                count = store.add(key, _CLOSED) - _CLOSED
                break
            if not is_main and waited > wait_s:
                raise RuntimeError(f"{kind}: waited {wait_s:.0f} s for the main process to make the same "
                                   "call (collective_timeout_s)")
            time.sleep(0.002)
            count = store.add(key, 0)
        calls.clear()
        calls[step] = n + 1
        if count < _CLOSED:
            return count >= world
        # (not the main process) the main process made a call alone under this key: this
        # process's call is the next one
        n += 1


_ALONE: ContextVar[bool] = ContextVar("shardwise_alone", default=False)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside, this process works by itself on purpose (a checkpoint the main process writes
    alone, of replicated state): the checkpoint code's agreements are its own and it runs no
    collective (`is_alone`). Said explicitly by the caller; the process group is untouched."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def is_alone() -> bool:
    """Inside `alone()`."""
    return _ALONE.get()
