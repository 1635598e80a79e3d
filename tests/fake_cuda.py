"""The GPU's rules on a CPU build: what a run on CUDA would do, recorded instead of done.

No test machine has a GPU, and the code only a GPU runs is where a move of an offloaded shard
onto the device, a thread on another process's GPU or a pinned block twice its size hides. Two
pieces make those visible on CPU:

- `DeviceMoves`: a torch function mode that records every tensor sent to a CUDA device
  (`Tensor.to("cuda")`, `.cuda()`, a factory with `device="cuda"`) and every page-locked
  allocation from torch's caching host allocator (`pin_memory=True`: it rounds each block up to a
  power of two), and carries on with the tensor where it was. With a mesh typed "cuda"
  (`cuda_mesh`: on a default group started as "cpu:gloo,cuda:gloo", so its collectives run on
  gloo), a DTensor keeps a CPU local part, and any implicit move to the mesh's device (what
  `DTensor.from_local` and `distribute_tensor` do) is a recorded move.
- `FakeCuda`: `torch.cuda` as a process with `devices` GPUs sees it: `is_available`,
  `device_count`, `set_device` and `current_device` per thread (a new thread starts on GPU 0, as
  CUDA's does), streams and events that do nothing, `synchronize` (counted, with the time it
  ran), one generator state per device (an unknown device raises, as CUDA's "invalid device
  ordinal"), and `cudart().cudaHostRegister` (the bytes registered, exact).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.as_tensor, torch.randn,
              torch.rand, torch.arange, torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like}


def caching_block(nbytes: int) -> int:
    """The block torch's caching host allocator hands out for `nbytes` (the next power of two)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes else 0


class DeviceMoves(TorchFunctionMode):
    """Every move to a CUDA device (`moves`: (what, shape)) and every caching-allocator pinned
    block (`pinned_blocks`: bytes, rounded as the allocator rounds) while active, on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[str, tuple[int, ...]]] = []
        self.pinned_blocks: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **parse)
            if device is not None and device.type == "cuda":
                self.moves.append(("to", tuple(args[0].shape)))
                return args[0].to(dtype, copy=bool(kwargs.get("copy"))) if dtype is not None else args[0]
        if func is torch.Tensor.cuda:
            self.moves.append(("cuda", tuple(args[0].shape)))
            return args[0]
        if func in _FACTORIES:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs.pop("device")
                out = func(*args, **kwargs)
                self.moves.append((f"{func.__name__}(device=cuda)", tuple(out.shape)))
                return out
            if kwargs.pop("pin_memory", False):
                out = func(*args, **kwargs)
                self.pinned_blocks.append(caching_block(out.numel() * out.element_size()))
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_mesh(shape: tuple[int, ...] = (1,), names: tuple[str, ...] = ("dp",)) -> Iterator[Any]:
    """A mesh typed "cuda" over this process alone, its group gloo's ("cpu:gloo,cuda:gloo"), in
    pytest's own process; the group goes at the end. Where an earlier test of this process left
    a default group of its own (a world of one), the mesh is made on it without groups of its
    own (`_init_backend=False`: the checks here send nothing)."""
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a process group of several processes is up in pytest's process"
        yield DeviceMesh("cuda", torch.arange(1).reshape(shape), mesh_dim_names=names, _init_backend=False)
        return
    dist.init_process_group("cpu:gloo,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cuda", torch.arange(1).reshape(shape), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or _Event()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Event(_Stream):
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass
class FakeCuda:
    """`torch.cuda` of a process seeing `devices` GPUs (see the module docstring); apply with
    `install(monkeypatch)`."""

    devices: int = 2
    registered: dict[int, int] = field(default_factory=dict)  # data_ptr -> bytes (cudaHostRegister)
    set_by_thread: dict[str, list[int]] = field(default_factory=dict)  # thread name -> set_device calls
    syncs: list[float] = field(default_factory=list)  # perf_counter at each synchronize
    rng: dict[int, torch.Tensor] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        for d in range(self.devices):  # a distinct state per device
            self.rng[d] = torch.randint(0, 255, (16,), dtype=torch.uint8, generator=gen)

    # -- devices --------------------------------------------------------------------------------
    def _index(self, device: Any = None) -> int:
        if device is None:
            return self.current_device()
        index = device.index if isinstance(device, torch.device) else (
            torch.device(device).index if isinstance(device, str) else int(device))
        index = self.current_device() if index is None else index
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index} of {self.devices} visible)")
        return index

    def set_device(self, device: Any) -> None:
        index = self._index(device)
        self.set_by_thread.setdefault(threading.current_thread().name, []).append(index)
        self._local.device = index

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)  # a new thread starts on GPU 0

    # -- generators -----------------------------------------------------------------------------
    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.rng[self._index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.rng[self._index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.rng[d].clone() for d in range(self.devices)]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for d, state in enumerate(states):
            self.set_rng_state(state, d)

    # -- host memory ----------------------------------------------------------------------------
    def cudart(self) -> Any:
        fake = self

        class _Runtime:
            @staticmethod
            def cudaHostRegister(ptr: int, size: int, flags: int) -> int:
                fake.registered[ptr] = size
                return 0

            @staticmethod
            def cudaHostUnregister(ptr: int) -> int:
                fake.registered.pop(ptr, None)
                return 0

        return _Runtime()

    def synchronize(self, device: Any = None) -> None:
        self.syncs.append(time.perf_counter())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        cuda = torch.cuda
        for name, value in {
            "is_available": lambda: True, "device_count": lambda: self.devices, "set_device": self.set_device,
            "current_device": self.current_device, "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state, "get_rng_state_all": self.get_rng_state_all,
            "set_rng_state_all": self.set_rng_state_all, "cudart": self.cudart,
            "synchronize": self.synchronize,
            "current_stream": lambda device=None: _Stream(), "Stream": _Stream, "Event": _Event,
            "is_initialized": lambda: True,
        }.items():
            monkeypatch.setattr(cuda, name, value)
        return self


