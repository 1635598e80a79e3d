"""Where an `Engine`'s process sits, and the calls about the processes: `ProcessVerbs`, mixed
into `Engine` (which holds the `DistInfo` and the `Supervisor`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.world import DistInfo
from ..runtime.supervision import Supervisor
from .lone import LoneCalls


class ProcessVerbs:
    """Rank, world and device of this process, barriers, and the guard's timeouts."""

    _info: DistInfo
    _supervisor: Supervisor
    _lone: LoneCalls

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

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self._lone.common("wait_for_everyone")
        # moved on, for a call the main process makes alone
        self._supervisor.heartbeat("waiting for everyone")
        dist.barrier()
        self._lone.after_barrier()  # the next call meets the main process's (`engine.lone`)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def timeouts(self) -> contextlib.AbstractContextManager[None]:
        """Inside, a collective that outlasts `collective_timeout_s` raises, naming who is late."""
        return self._supervisor.timeouts()

    def meet(self, event: str) -> None:
        """A collective every process makes now, issued by the caller itself (`event` names it):
        after `wait_for_everyone()` it first meets the main process's next call, and serves it
        when that is a call the main process makes alone (`engine.lone`)."""
        self._lone.common(event)

    def others_moved_on(self) -> bool:
        """The other processes' heartbeats are ahead of this one's (it makes a call alone)."""
        return self._supervisor.others_moved_on()

    @contextlib.contextmanager
    def as_world_of_one(self) -> Iterator[None]:
        """Inside, this engine is process 0 of a world of one (a lone process writes a complete
        single-process checkpoint of replicated state); the process group is untouched."""
        info = self._info
        self._info = dataclasses.replace(info, rank=0, world_size=1, local_rank=0, local_world_size=1)
        try:
            yield
        finally:
            self._info = info
