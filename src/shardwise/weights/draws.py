"""Keeping the CPU generator in step with a normal build, without the tensor a draw would fill.

Under `init_empty()` a random initializer (`normal_`, `kaiming_uniform_`, ...) called on a meta
parameter draws nothing, yet the constructor's next draws (the next layer's, a real buffer's)
must be the ones a normal build makes. torch's CPU generator is a Mersenne twister, and the
kernels that initializers reach consume it in a way fixed by the kernel, dtype, size and layout:

- `uniform_` (and `kaiming_uniform_`, `xavier_uniform_`): one 32-bit draw per element, serially
  (two for float64);
- a contiguous `normal_` of n >= 16 elements (and `kaiming_normal_`, `xavier_normal_`,
  `orthogonal_`'s fresh matrix): Box-Muller over blocks of 16 uniforms, plus one more block for
  a ragged tail (float32 and float64 draw n + 16 then; the 16-bit dtypes round n up to 16);
- `trunc_normal_` draws one `normal_` and redraws only values outside [a, b], which cannot
  happen when a and b lie beyond the largest value the kernel can produce (|z| < 5.8 in float32,
  8.6 in float64: Box-Muller's radius at the smallest uniform).

So a write's draws are counted, not made: the generator is moved on by that many 32-bit draws
in chunks of `CHUNK` elements, a constant amount of memory whatever the parameter's size.

Kernels can differ by CPU and torch version, so each count is checked once per `Stepper` (one
`init_empty()` block) against the real kernel on small tensors of the same dtype, and a kernel
whose count does not hold is not counted. A write whose draws are not counted (a non-contiguous
`normal_`, whose serial Box-Muller keeps a spare sample in the generator; a rejection sampler
that may redraw; any other function) runs once on a scratch tensor of its own shape: bounded
for tensors up to `SMALL` elements, and reported once for a larger one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..distributed.internals import no_grad_trunc_normal

log = logging.getLogger("shardwise")

CHUNK = 1 << 18  # elements per step of the generator (1 MiB of float32)
SMALL = 1 << 16  # a write to at most this many elements may simply run on a scratch tensor

_UNIFORM = {"uniform_", "kaiming_uniform_", "xavier_uniform_", "_no_grad_uniform_"}
_NORMAL = {"normal_", "kaiming_normal_", "xavier_normal_", "_no_grad_normal_", "orthogonal_"}
_TRUNC = {"trunc_normal_", "_no_grad_trunc_normal_"}
_FRESH = {"orthogonal_"}  # draws into a new contiguous matrix of the parameter's size, not into it
# the largest |z| Box-Muller gives in each dtype (radius at the smallest uniform), with a margin
_REACH = {torch.float32: 6.0, torch.float64: 9.0}


def kernel_of(name: str, arguments: dict[str, Any], dtype: torch.dtype) -> str | None:
    """"uniform" or "normal": the kernel whose draws a call named `name` makes on its tensor,
    or None when its draws cannot be counted. `arguments`: the call's keyword arguments."""
    if name in _UNIFORM:
        return "uniform"
    if name in _NORMAL:
        return "normal"
    if name in _TRUNC and _never_rejects(arguments, dtype):
        return "normal"
    return None


def _never_rejects(arguments: dict[str, Any], dtype: torch.dtype) -> bool:
    """trunc_normal_ keeps its first normal_ draw whole: [a, b] lies beyond what it can draw
    (and its normal branch, p > 0.3, is taken)."""
    reach = _REACH.get(dtype)
    try:
        mean, std = float(arguments.get("mean", 0.0)), float(arguments.get("std", 1.0))
        a, b = float(arguments.get("a", -2.0)), float(arguments.get("b", 2.0))
    except (TypeError, ValueError):
        return False
    return reach is not None and std > 0 and (b - mean) / std > reach and (mean - a) / std > reach


def count(kernel: str, n: int, dtype: torch.dtype, contiguous: bool) -> int | None:
    """32-bit draws `kernel` makes filling `n` elements of `dtype` (None: not counted)."""
    per = 2 if dtype == torch.float64 else 1
    if kernel == "uniform":
        return per * n
    if n < 16 or not contiguous:
        return None
    if dtype in (torch.float32, torch.float64):
        return per * (n + (16 if n % 16 else 0))
    return n + (-n) % 16


def skip(generator: torch.Generator, draws: int, buf: torch.Tensor | None = None) -> None:
    """Move `generator` on by `draws` 32-bit draws (float32 `uniform_` draws one per element),
    `buf.numel()` at a time (a float32 buffer to reuse; by default one of up to `CHUNK`)."""
    if draws <= 0:
        return
    if buf is None:
        buf = torch.empty(min(draws, CHUNK), dtype=torch.float32)
    while draws:
        part = buf[: min(draws, buf.numel())]
        part.uniform_(generator=generator)
        draws -= part.numel()


def _kernel_call(kernel: str) -> Callable[[torch.Tensor, torch.Generator], Any]:
    if kernel == "uniform":
        return lambda t, g: t.uniform_(generator=g)
    return lambda t, g: t.normal_(generator=g)


def _holds(kernel: str, dtype: torch.dtype) -> bool:
    """`count` agrees with the real kernel on small tensors of `dtype` (sizes with and without
    a ragged 16-tail)."""
    run = _kernel_call(kernel)
    for n in (1000, 1024, 4097):
        ran, stepped = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        run(torch.empty(n, dtype=dtype), ran)
        draws = count(kernel, n, dtype, True)
        if draws is None:
            return False
        skip(stepped, draws)
        if not torch.equal(ran.get_state(), stepped.get_state()):
            return False
    return True


def _trunc_holds(dtype: torch.dtype) -> bool:
    """trunc_normal_ with unreachable bounds draws exactly one normal_."""
    ran, stepped = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    no_grad_trunc_normal()(torch.empty(1000, dtype=dtype), 0.0, 0.02, -2.0, 2.0, generator=ran)
    stepped_t = torch.empty(1000, dtype=dtype)
    stepped_t.normal_(generator=stepped)
    return torch.equal(ran.get_state(), stepped.get_state())


class Stepper:
    """Moves generators on for random writes to meta tensors (see the module doc)."""

    def __init__(self) -> None:
        self.checked: dict[tuple[str, torch.dtype], bool] = {}
        self.reported: set[tuple[str, tuple[int, ...]]] = set()
        # one buffer for every step of the block: a new one per write would leave the heap a
        # hole per parameter (small allocations kept in between pin it)
        self.buf = torch.empty(0, dtype=torch.float32)

    def draws(self, name: str, arguments: dict[str, Any], part: torch.Tensor) -> int | None:
        """The 32-bit draws a call named `name` makes writing `part` (a meta tensor of the
        written shape and layout), when its kernel's count holds here."""
        kernel = kernel_of(name, arguments, part.dtype)
        if kernel is None:
            return None
        key = ("trunc" if name in _TRUNC else kernel, part.dtype)
        if key not in self.checked:
            ok = _holds(kernel, part.dtype)
            self.checked[key] = ok and (key[0] != "trunc" or _trunc_holds(part.dtype))
        if not self.checked[key]:
            return None
        return count(kernel, part.numel(), part.dtype, name in _FRESH or part.is_contiguous())

    def skip(self, generator: torch.Generator, draws: int) -> None:
        """`skip` with this stepper's buffer."""
        if self.buf.numel() < min(draws, CHUNK):
            self.buf = torch.empty(CHUNK, dtype=torch.float32)
        skip(generator, draws, self.buf)

    def step(self, name: str, arguments: dict[str, Any], part: torch.Tensor,
             generator: torch.Generator, scratch: Callable[[torch.Tensor], Any]) -> None:
        """Move `generator` on as the call would: by counted draws, else by running it
        (`scratch(tensor)`) on a real tensor of `part`'s shape."""
        draws = self.draws(name, arguments, part)
        if draws is not None:
            self.skip(generator, draws)
            return
        n = part.numel()
        if n > SMALL and (name, tuple(part.shape)) not in self.reported:
            self.reported.add((name, tuple(part.shape)))
            log.warning("init_empty: %s on a %s %s tensor draws a number of values shardwise cannot "
                        "count; it runs once on a scratch tensor of that size (%.1f MiB) to keep the "
                        "generator in step", name, list(part.shape), str(part.dtype).removeprefix("torch."),
                        n * part.element_size() / 2**20)
        with torch.no_grad():
            scratch(torch.empty_strided(part.shape, part.stride(), dtype=part.dtype))

