"""`gather` and `reduce` over every process, for tensors nested in dicts, lists and tuples.

gloo (and NCCL) all-gather only equal shapes, and a tensor whose dtype or trailing shape differs
across processes would make the collective fail, or worse, mix bytes. So `gather` first shares
each process's (length, dtype, trailing shape) in one small all-gather (the one it needs anyway
to pad to the longest length), refuses a mismatch with one line naming every process's shape,
pads to the longest, gathers, and trims.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_REDUCTIONS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}


def map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor inside dicts, lists and tuples (the structure is kept)."""
    if torch.is_tensor(data):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: map_tensors(v, fn) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    raise TypeError(f"expected tensors (or dicts/lists/tuples of them), got {type(data).__name__}")


def _describe(meta: torch.Tensor) -> str:
    n, ndim, code = (int(x) for x in meta[:3])
    shape = (n, *(int(d) for d in meta[3 : 3 + max(ndim - 1, 0)]))
    dtype = str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "?"
    return f"{dtype} {tuple(shape)}"


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh when it is split; a replicated one's
    local copy), or `t` itself: what the collectives here take."""
    if isinstance(t, DTensor):
        return t.full_tensor() if any(not p.is_replicate() for p in t.placements) else t.to_local()
    return t


def gather_one(t: torch.Tensor, world: int, keep: Sequence[int] | None = None) -> torch.Tensor:
    """Every process's `t`, concatenated along dim 0 (a collective; lengths may differ); `keep`:
    only these processes' parts (one per tensor-parallel group, whose processes hold the same)."""
    t = t.detach()
    if t.dim() == 0:
        t = t[None]
    if world == 1:
        return t
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"gather takes tensors of up to {_MAX_DIMS} dims of a standard dtype, "
                         f"got {t.dtype} {tuple(t.shape)}")
    meta = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=t.device)
    meta[0], meta[1], meta[2] = t.shape[0], t.dim(), _DTYPES.index(t.dtype)
    meta[3 : 3 + t.dim() - 1] = torch.tensor(t.shape[1:], dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta)
    if any(not torch.equal(m[1:], meta[1:]) for m in metas):
        shapes = "; ".join(f"rank {r} has {_describe(m.cpu())}" for r, m in enumerate(metas))
        raise ValueError(
            "gather needs the same dtype and the same shape except dim 0 on every process (dim 0 "
            f"may differ): {shapes}"
        )
    lengths = [int(m[0]) for m in metas]
    padded = t.new_zeros((max(lengths), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    ranks = range(world) if keep is None else keep
    return torch.cat([parts[r][: lengths[r]] for r in ranks])


def reduce_one(t: torch.Tensor, reduction: str, world: int, copies: int = 1) -> torch.Tensor:
    """`t` summed (or averaged, or its max or min) over every process (a collective); `copies`:
    processes holding each value (a tensor-parallel group's), counted once in a sum."""
    out = t.detach().clone()
    if world > 1:
        dist.all_reduce(out, op=_REDUCTIONS[reduction])
    if reduction == "mean":
        return out / world
    if reduction == "sum" and copies > 1:
        return out // copies if not out.is_floating_point() else out / copies
    return out


def check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not valid; choose one of: {', '.join(_REDUCTIONS)}")
