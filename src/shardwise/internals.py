"""The private torch names shardwise touches, each behind one function here.

torch has no public spelling for these; keeping them in one module means a torch upgrade is
checked in one place (`tests/test_layering.py` fails on a private torch name read anywhere
else, save nn.Module's `_parameters`/`_buffers` dictionaries, which torch itself documents for
subclass authors). Checked against torch 2.13.0.

- `DTensor._local_tensor`: the rank's shard of a DTensor without an autograd node
  (`DTensor.to_local()` records one when grad mode is on).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage FSDP2 keeps), or `t` itself for a plain tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    """`t` is a DTensor (or DeepSpeed-partitioned tensor is asked elsewhere): a shard of a whole."""
    return isinstance(t, DTensor)


def shard_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's shard of `t` within the whole tensor
    (`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)
