"""Accelerate's per-process helpers, for `Accelerator`: decorators that run a function on one
process only, this process's share of a list, padding across processes, and a flag any process
can raise for all (`set_trigger` / `check_trigger`).

`ProcessHelpers` is mixed into `Accelerator`, which provides where the process sits and the
collectives (from its engine).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from ..engine import Engine

F = TypeVar("F", bound=Callable[..., Any])


def _on(function: F, here: Callable[[], bool]) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if here() else None

    return wrapper  # type: ignore[return-value]


class ProcessHelpers:
    """Accelerate's `on_*_process` decorators, `split_between_processes`, `pad_across_processes`
    and the trigger flag."""

    engine: Engine  # the `Engine` the Accelerator composes
    flag_tensor: torch.Tensor | None = None

    # -- where this process sits (the engine's) ------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def num_processes(self) -> int:
        return self.engine.num_processes

    @property
    def process_index(self) -> int:
        return self.engine.process_index

    @property
    def local_process_index(self) -> int:
        return self.engine.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.engine.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.engine.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.engine.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.engine.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.main_process_first()

    def gather(self, data: Any) -> Any:
        return self.engine.gather(data)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        return self.engine.reduce(data, reduction)

    # -- on which process ------------------------------------------------------------------
    def on_main_process(self, function: F) -> F:
        return _on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: F) -> F:
        return _on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: F) -> F:
        return _on(function, lambda: self.is_last_process)

    def on_process(self, function: Any = None, process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _on(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Any = None, local_process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _on(function, lambda: self.local_process_index == local_process_index)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of them."""
        n, r = self.num_processes, self.process_index

        def share(x: Any) -> Any:
            if isinstance(x, dict):
                return {k: share(v) for k, v in x.items()}
            per, extra = divmod(len(x), n)
            start = r * per + min(r, extra)
            part = x[start : start + per + (1 if r < extra else 0)]
            if apply_padding and len(part) < per + (1 if extra else 0):
                part = part + part[-1:] if not torch.is_tensor(part) else torch.cat([part, part[-1:]])
            return part

        yield share(inputs)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> Any:
        """Pad `tensor` along `dim` to the largest size across processes (to gather it)."""
        if not torch.is_tensor(tensor) or self.num_processes == 1 or tensor.ndim == 0:
            return tensor
        size = torch.tensor(tensor.shape[dim], device=self.device)
        top = int(self.reduce(size, "max").item())
        if top == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = top
        out = tensor.new_full(shape, pad_index)
        index = [slice(None)] * tensor.ndim
        index[dim] = slice(top - tensor.shape[dim], top) if pad_first else slice(0, tensor.shape[dim])
        out[tuple(index)] = tensor
        return out

    # -- a flag any process raises for all ---------------------------------------------------
    def set_trigger(self) -> None:
        """Raise a flag on this process that `check_trigger()` sees on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger()` (then reset)."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        if self.reduce(flag, "sum").item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False


@contextlib.contextmanager
def trigger_sync_in_backward(model: Any) -> Iterator[None]:
    """The next backward all-reduces even inside an accumulation (DDP; elsewhere a no-op, as in
    Accelerate)."""
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    old = model.require_backward_grad_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync = old


@contextlib.contextmanager
def join_uneven_inputs(acc: Any, joinables: list[Any], even_batches: bool | None) -> Iterator[None]:
    """`Accelerator.join_uneven_inputs`: torch's Join for DDP models; elsewhere a warning (as in
    Accelerate). `even_batches` holds inside, if given."""
    before = acc.even_batches
    if even_batches is not None:
        acc.even_batches = even_batches
    try:
        if acc.num_processes > 1 and all(isinstance(j, DistributedDataParallel) for j in joinables):
            from torch.distributed.algorithms.join import Join

            with Join(joinables):
                yield
        else:
            if acc.num_processes > 1:
                warnings.warn("join_uneven_inputs() joins DDP models only; nothing is joined here",
                              stacklevel=3)
            yield
    finally:
        acc.even_batches = before


def all_tensors(data: Any) -> bool:
    """Tensors only, in nested dicts, lists and tuples (gathered as tensors, not as objects)."""
    if torch.is_tensor(data):
        return True
    if isinstance(data, dict):
        return all(all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(all_tensors(v) for v in data)
    return False
