"""What an init recipe keeps of a real tensor (see `shardwise.weights.record`): the tensor itself
when it is small, else the calls that made it inside `init_empty()` (`Made`, run again at
`prepare`), else a temporary file (`Spilled`). A recorded call (`Call`) holds its arguments the
same way, with `SELF` where the tensor it writes goes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed.internals import tree_map

SELF = object()  # stands for the written tensor in a recorded call's arguments


@dataclass(slots=True)
class Call:
    func: Callable[..., Any]
    args: tuple[Any, ...]  # SELF where the target goes; real tensors held (see `Recorder.hold`)
    kwargs: dict[str, Any]
    gen_states: dict[int, torch.Tensor] = field(default_factory=dict)  # position of a Generator arg -> state

    def run(self, target: torch.Tensor | None = None) -> Any:
        def sub(a: Any) -> Any:
            if a is SELF:
                return target
            if isinstance(a, (Made, Spilled)):
                return a.value()
            return a

        args = [tree_map(sub, a) if isinstance(a, (list, tuple)) else sub(a) for a in self.args]
        kwargs = {k: sub(v) for k, v in self.kwargs.items()}
        for pos, state in self.gen_states.items():  # a generator the call was given: as it was then
            g = torch.Generator().set_state(state)
            if pos >= 0:
                args[pos] = g
            else:
                kwargs["generator"] = g
        return self.func(*args, **kwargs)


@dataclass(slots=True, eq=False)
class Made:
    """A real tensor made inside `init_empty()` by calls the recorder saw, made again on demand."""

    call: Call | None  # the call that made it; None: torch.empty (no value)
    rng: torch.Tensor | None  # the CPU generator state before that call, if it drew
    shape: tuple[int, ...]
    dtype: torch.dtype
    into: Made | None = None  # an in-place call: the value it wrote into

    def value(self) -> torch.Tensor:
        if self.call is None:
            return torch.empty(self.shape, dtype=self.dtype)
        base = self.into.value() if self.into is not None else None
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if self.rng is not None:
                torch.set_rng_state(self.rng)
            out = self.call.run(base)
        return base if base is not None else out


class Spilled:
    """A large real tensor made outside what the recorder saw, kept in a temporary file (removed
    with this object) instead of in memory until `prepare` reads it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self.nbytes = raw.numel()
        fd, self.path = tempfile.mkstemp(prefix="shardwise-init-", suffix=".bin")
        with os.fdopen(fd, "wb") as f:
            raw.numpy().tofile(f)
        weakref.finalize(self, _unlink, self.path)

    def value(self) -> torch.Tensor:
        raw = torch.from_file(self.path, shared=False, size=self.nbytes, dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.shape)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


Held = torch.Tensor | Made | Spilled  # what a recipe keeps of a real tensor
