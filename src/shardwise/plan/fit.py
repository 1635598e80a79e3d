"""From a few traces to any batch size: the memory model, the largest batch, the step time.

A configuration is traced at two batch sizes b1 < b2 and, for a deep model, at two depths
(`TRACE_DEPTHS`, the stack cut to 3 and 4 blocks). Every quantity the traces report (a
segment's peak, its role breakdown, FLOPs, bytes communicated) is treated as

    q(L, B) = q0 + qL*L + qB*B + qLB*L*B

which is exact for the parts of a training step (state grows with the depth, activations with
depth x batch, the head and loss with the batch alone). The value at the model's real depth and
any batch is then a weighted sum of the traced values. The per-rank peak is the largest segment
after extrapolation: taking the maximum *after* extrapolating each segment, not before, matters
because the segment that dominates a shallow trace (the head and loss) is rarely the one that
dominates the real model (the bottom or top of the stack).

What a trace cannot see is added as stated, overridable terms (`Overheads`): on a CUDA device,
the CUDA context with the kernels and library workspaces it loads, NCCL's communication
buffers, and the caching allocator's fragmentation (memory it has reserved but no live tensor
uses). On a CPU target they are zero: there the planner predicts live tensor bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..strategies.precision import DTYPES
from .trace import ROLES, SegmentPeak, TraceResult

GiB = 2**30
MAX_BATCH = 1 << 16
Key = tuple[int | None, int]  # (traced depth or None for the full model, batch)


@dataclass(frozen=True, slots=True)
class Overheads:
    """Device memory a trace of tensors cannot see. Override any term to match your setup."""

    cuda_context: float = 0.6 * GiB
    """CUDA context, loaded kernels, cuBLAS/cuDNN workspaces (outside the caching allocator)."""
    nccl_buffers: float = 0.4 * GiB
    """NCCL's communicator buffers and streams, per process, when there is more than one."""
    fragmentation: float = 0.08
    """Fraction of the peak of live tensors that the caching allocator holds on top of it."""

    def fixed(self, device: str, world_size: int) -> float:
        if device != "cuda":
            return 0.0
        return self.cuda_context + (self.nccl_buffers if world_size > 1 else 0.0)

    def frag(self, device: str) -> float:
        return self.fragmentation if device == "cuda" else 0.0


@dataclass(frozen=True, slots=True)
class Hardware:
    """Speeds used to turn FLOPs and bytes into an estimated step time (relative use only)."""

    flops_bf16: float = 150e12
    """Sustained bf16/fp16 FLOP/s of one device on a transformer step."""
    flops_fp32: float = 40e12
    """Sustained fp32 FLOP/s (TF32 matmuls where enabled)."""
    interconnect: float = 25e9
    """Bus bandwidth between devices in bytes/s (PCIe peer-to-peer; NVLink is ~10x)."""
    inter_node: float = 12.5e9
    """Bandwidth per process between nodes in bytes/s (a 100 Gb/s network link per GPU)."""
    pcie: float = 20e9
    """Host<->device copy bandwidth in bytes/s (offload)."""
    host_adam: float = 1.0e9
    """Parameters per second the host optimizer step updates (offload)."""

    @staticmethod
    def cpu() -> Hardware:
        """Rough speeds of CPU processes talking through gloo on one machine."""
        return Hardware(flops_bf16=20e9, flops_fp32=50e9, interconnect=2e9, inter_node=1e9, pcie=1e12,
                        host_adam=1e12)

    def flops(self, precision: str) -> float:
        """The sustained rate at `precision`: fp32's for 4-byte compute, else the 16-bit one."""
        return self.flops_fp32 if DTYPES[precision].itemsize == 4 else self.flops_bf16


def comm_factor(kind: str, world: int) -> float:
    """Bytes each rank sends per byte of the collective's full buffer (ring algorithms), over
    the world or, for a kind "name@G" (`counter`), over a group of G ranks (tensor parallelism,
    hybrid sharding)."""
    if "@" in kind:
        kind, group = kind.split("@")
        world = int(group.split(":")[0])
    if world <= 1:
        return 0.0
    share = (world - 1) / world
    return 2 * share if kind.startswith("allreduce") else share


@dataclass(frozen=True, slots=True)
class Memory:
    """Predicted bytes at one batch size."""

    device: float  # live tensors on the device (everything on a CPU target)
    roles: dict[str, float]  # breakdown of `device` by role
    host: float  # live tensors kept on the host (offload; CUDA targets only)
    segment: str  # where in the step the device peak happens


class Fitted:
    """One configuration's traces, evaluated at the model's depth and any batch."""

    def __init__(self, traces: dict[Key, TraceResult], depth: int | None, trace_depths: tuple[int, int],
                 world_size: int, device: Literal["cuda", "cpu"]) -> None:
        self.traces = traces
        self.depth = depth
        self.world = world_size
        self.device = device
        self.batches = sorted({b for _, b in traces})
        self.trace_depths: tuple[int, ...] = trace_depths if depth is not None else ()
        results = list(traces.values())
        field = "device" if device == "cuda" else "total"
        self._field = field
        self.segments = sorted(set.intersection(*(set(getattr(r, field)) for r in results)))

    def _weights(self, batch: float) -> dict[Key, float]:
        b1, b2 = self.batches[0], self.batches[-1]
        wb = {b1: 1.0} if b1 == b2 else {b1: (b2 - batch) / (b2 - b1), b2: (batch - b1) / (b2 - b1)}
        if self.depth is None:
            wl: dict[int | None, float] = {None: 1.0}
        else:
            l1, l2 = self.trace_depths
            wl = {l1: (l2 - self.depth) / (l2 - l1), l2: (self.depth - l1) / (l2 - l1)}
        return {(depth, b): x * y for depth, x in wl.items() for b, y in wb.items()}

    def memory(self, batch: float) -> Memory:
        w = self._weights(batch)
        best: tuple[float, str, dict[str, float]] | None = None
        for seg in self.segments:
            peaks: list[tuple[float, SegmentPeak]] = [(x, getattr(self.traces[k], self._field)[seg])
                                                      for k, x in w.items()]
            paths = [p.trajectory for _, p in peaks]
            if all(t is not None for t in paths) and len({t.shape for t in paths}) == 1:
                # the same moments in every trace: extrapolate each, then take the peak
                at = sum(x * t for (x, _), t in zip(peaks, paths, strict=True))
                i = int(at.sum(axis=1).argmax())
                total, roles = float(at[i].sum()), {r: float(at[i, j]) for j, r in enumerate(ROLES)}
            else:  # the traces differ in their events: extrapolate the peaks
                total = sum(x * p.total for x, p in peaks)
                roles = {r: sum(x * p.roles.get(r, 0.0) for x, p in peaks) for r in ROLES}
            if best is None or total > best[0]:
                best = (total, seg, roles)
        host = 0.0
        if self.device == "cuda":
            host = max(sum(x * self.traces[k].host.get(seg, 0.0) for k, x in w.items())
                       for seg in self.segments)
        assert best is not None
        return Memory(device=max(best[0], 0.0), roles=best[2], host=max(host, 0.0), segment=best[1])

    def linear(self, attr: str, batch: float) -> float:
        return float(sum(x * getattr(self.traces[k], attr) for k, x in self._weights(batch).items()))

    def comm_bytes(self, kind: str) -> float:
        """The full buffers of the collectives keyed `kind` (`counter`: "allreduce@2" is an
        all-reduce over 2 consecutive ranks) in one step at the first traced batch, at the
        model's depth."""
        w = self._weights(self.batches[0])
        return float(sum(x * self.traces[k].comm_bytes.get(kind, 0.0) for k, x in w.items()))

    def comm_kinds(self) -> set[str]:
        """Every key of a collective the traces counted (`counter`: "allreduce@2", "alltoall_base")."""
        return {kind for r in self.traces.values() for kind in r.comm_bytes}

    def comm_seconds(self, hw: Hardware) -> float:
        w = self._weights(self.batches[0])
        total = 0.0
        for kind in self.comm_kinds():
            nbytes = sum(x * self.traces[k].comm_bytes.get(kind, 0.0) for k, x in w.items())
            total += nbytes * comm_factor(kind, self.world)
        return total / hw.interconnect


def largest_batch(fits: Callable[[int], bool], limit: int = MAX_BATCH) -> int:
    """The largest b in 1..limit with fits(b) (0 if none), for a monotone `fits`."""
    if not fits(1):
        return 0
    good, step = 1, 1
    while good + step <= limit and fits(good + step):
        good += step
        step *= 2
    while step > 1:
        step //= 2
        if good + step <= limit and fits(good + step):
            good += step
    return good
