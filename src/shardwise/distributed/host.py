"""Page-locked host memory for a device's copies, of exactly the bytes asked.

A pinned tensor from `torch.empty(..., pin_memory=True)` (or `.pin_memory()`) takes its block
from torch's caching host allocator, which rounds every size up to a power of two: a 20 000-byte
shard holds 32 768, and host memory that `memory_report()` and the planner count at the tensor's
size can be up to twice that. Memory held for a whole run (offloaded optimizer masters and their
gradients, a checkpoint's staging buffers) is plain host memory registered with CUDA instead
(`cudaHostRegister`, unregistered when the tensor is freed), as torch's own asynchronous
checkpoint stages it. Short-lived copies that the allocator recycles step after step (activation
offload) keep the caching allocator.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["pinned"]


def pinned(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor whose memory is exactly its bytes."""
    buf = torch.empty(shape, dtype=dtype)
    nbytes = buf.numel() * buf.element_size()
    if nbytes:
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} host bytes failed: cudaError {code}")
        # unregistered with the memory (its storage), not with this tensor object: a Parameter
        # or a view made of it may outlive `buf`
        weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, buf.data_ptr())
    return buf
