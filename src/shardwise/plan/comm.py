"""Bytes each rank sends per optimizer step, within its sharding group and across groups.

Computed from the parameter count and the precision, for full sharding (one group of all W
processes) and hybrid sharding (groups of G processes, one per node; R = W / G replicas):

    zero3  all-gather the parameters twice (forward, and again in backward) and reduce-scatter
           the gradients, within the group; hybrid then all-reduces each rank's 1/G gradient
           shard across the R replicas.
    zero2  the same with one all-gather (the parameters stay gathered from forward to backward).
    zero1  DDP all-reduces whole gradients over all W processes; each rank steps its slice of
           the optimizer and the updated parameters are all-gathered within the group.
    ddp    the gradient all-reduce over all W processes.
Every strategy adds the step boundary's agreement (`runtime.supervision`): one all-reduce of
four fp32 flags over all W processes (BOUNDARY_BYTES).

A collective's cost per rank is what a ring algorithm sends (bandwidth-optimal, what NCCL's
rings do): all-gather and reduce-scatter (g-1)/g of the full buffer, all-reduce 2(g-1)/g. A
collective counts as *inter-node* when its group spans two nodes (the ring then runs at the
speed of the slowest link it crosses), else as *intra-node*. Parameters are gathered in the
compute dtype (FSDP2's `param_dtype`: 2 bytes under bf16/fp16) by zero2/zero3, whose gradients
are reduced in fp32 (`reduce_dtype`); zero1 and ddp keep fp32 parameters and gradients. FSDP2
pads each unit's shards to equal sizes; the padding (at most W-1 elements per unit) is not
counted. `benchmarks/comm.py` measures the same figures on real processes.

Tensor parallelism (`tensor_parallel_size` T): the data-parallel collectives above run over the
W / T data-parallel ranks, on the parameters one tp rank holds (the planned weights cut by T);
on top, every rowwise layer all-reduces its output activations (batch x seq x hidden) over the
T ranks of its node in forward, and the input gradient of the colwise layers feeding them is
all-reduced in backward: 2 + 2 per block with fused projections (GPT-2's c_attn, Megatron's
count: `tensor_parallel_bytes`), 2 + 5 for Llama (q, k, v, gate and up split one by one); ring
factor 2(T-1)/T, always within a node (`with_tensor_parallel`). The planner takes these bytes
from the trace, which runs the real TP code, not from the formula.

Expert parallelism (`expert_parallel_size` N, `with_expert_parallel`): the data-parallel
collectives above run on the parameters outside the experts; the experts are never gathered at
N = W, and below it (each experts module its own FSDP unit over the W / N ranks holding the same
experts; under zero1 held whole there, DDP leaving them out) gathered and reduced over those
ranks on 1/N of the experts (zero1: all-reduced, and its optimizer's slices all-gathered).
Every mixture-of-experts layer adds four all-to-alls of its T x k routed token slots
(hidden-size rows): tokens out and results back in forward, their gradients in backward (3
passes of forward under full activation checkpointing: recomputed); a rank sends (N-1)/N of
each (balanced routing, what the trace plans: `fakes.even_routing`). The counts exchanged first
(N integers per expert) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config.tree import strategy_spec

__all__ = ["KINDS", "CommVolume", "ring_bytes", "step_comm", "tensor_parallel_bytes", "with_expert_parallel",
           "with_tensor_parallel"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# bytes of one gathered parameter element by precision under FSDP2's MixedPrecisionPolicy (a
# lookup, not a rule: config has no precision table to ask); gradients are reduced in fp32
_GATHER_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_REDUCE_BYTES = 4
BOUNDARY_BYTES = 16  # the step boundary's flags: stop, launcher gone, time due, write failed


def ring_bytes(kind: str, nbytes: float, group: int) -> float:
    """Bytes one rank sends in a ring `kind` collective over `group` ranks whose full buffer
    (the gathered output, the reduce-scatter input, the all-reduced tensor) is `nbytes`."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group  # (all-to-all: what leaves the rank of an even split)
    return 2 * share * nbytes if kind == "all_reduce" else share * nbytes


@dataclass(frozen=True, slots=True)
class CommVolume:
    """Bytes one rank sends in one optimizer step, by kind of collective and by link."""

    intra: dict[str, float] = field(default_factory=dict)
    """collectives whose group lies within one node"""
    inter: dict[str, float] = field(default_factory=dict)
    """collectives whose group spans nodes"""

    @property
    def intra_bytes(self) -> float:
        """Everything sent within a node."""
        return sum(self.intra.values())

    @property
    def inter_bytes(self) -> float:
        """Everything sent across nodes."""
        return sum(self.inter.values())

    def __add__(self, other: CommVolume) -> CommVolume:
        """Both steps' bytes, kind by kind and link by link."""
        def merged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in (*a, *(k for k in b if k not in a))}
        return CommVolume(intra=merged(self.intra, other.intra), inter=merged(self.inter, other.inter))

    def seconds(self, intra_bandwidth: float, inter_bandwidth: float) -> float:
        """Communication time at these link speeds (bytes/s per process), nothing overlapped."""
        return self.intra_bytes / intra_bandwidth + self.inter_bytes / inter_bandwidth


def step_comm(strategy: str, parameters: float, precision: str, *, world_size: int, nodes: int = 1,
              group_size: int | None = None, boundary: bool = True) -> CommVolume:
    """Bytes each rank sends per optimizer step (see the module doc) for `parameters` trained
    with `strategy` on `world_size` processes over `nodes` nodes, sharded within groups of
    `group_size` consecutive ranks (None: one group of all processes); with the step boundary's
    flags unless `boundary` is False (a second part of the same step)."""
    group = world_size if group_size is None else group_size
    if group < 1 or world_size % group or world_size % nodes:
        raise ValueError(f"{world_size} processes do not split into groups of {group} on {nodes} nodes")
    per_node = world_size // nodes
    replicas = world_size // group
    spec = strategy_spec(strategy)
    gathered, reduced = parameters * _GATHER_BYTES[precision], parameters * _REDUCE_BYTES
    # a group of consecutive ranks spans nodes when it is larger than a node or straddles one
    group_spans = group > per_node or per_node % group != 0
    replicas_span = nodes > 1  # the replica group holds one rank of every group: on every node
    world_spans = nodes > 1
    volume: dict[bool, dict[str, float]] = {False: {}, True: {}}

    def add(kind: str, nbytes: float, size: int, spans: bool) -> None:
        sent = ring_bytes(kind, nbytes, size)
        if sent:
            scope = volume[spans]
            scope[kind] = scope.get(kind, 0.0) + sent

    if spec.shards_grads:  # zero2, zero3 (FSDP2): gradients reduce-scattered in the group
        add("all_gather", gathered * (2 if spec.regathers_in_backward else 1), group, group_spans)
        add("reduce_scatter", reduced, group, group_spans)
        add("all_reduce", reduced / group, replicas, replicas_span and replicas > 1)
    else:  # ddp, zero1: DDP's all-reduce of whole gradients over every process
        add("all_reduce", reduced, world_size, world_spans)
        if spec.shards_optimizer:  # zero1: the updated fp32 slices all-gathered in the group
            add("all_gather", parameters * 4, group, group_spans)
    if boundary:
        add("all_reduce", BOUNDARY_BYTES, world_size, world_spans)
    return CommVolume(intra=volume[False], inter=volume[True])


def tensor_parallel_bytes(rowwise_layers: int, batch: int, seq_len: int, hidden: int,
                          element_bytes: int) -> float:
    """The full buffers tensor parallelism all-reduces in one step: each rowwise layer's output
    (batch x seq_len x hidden elements) in forward and its gradient in backward."""
    return float(2 * rowwise_layers * batch * seq_len * hidden * element_bytes)


def with_tensor_parallel(volume: CommVolume, allreduced: float, tp: int, *, gathered: float = 0.0,
                         scattered: float = 0.0) -> CommVolume:
    """`volume` (the data-parallel collectives over world / tp ranks) plus tensor parallelism's
    all-reduces of `allreduced` bytes (`tensor_parallel_bytes`, or what a trace counted) over
    the `tp` ranks of one node: 2(tp-1)/tp of them sent per rank, never across nodes; with
    sequence parallelism, its all-gathers and reduce-scatters of `gathered` and `scattered` full
    buffers, (tp-1)/tp of each."""
    intra = dict(volume.intra)
    for kind, nbytes in (("all_reduce", allreduced), ("all_gather", gathered), ("reduce_scatter", scattered)):
        sent = ring_bytes(kind, nbytes, tp)
        if sent:
            intra[kind] = intra.get(kind, 0.0) + sent
    return CommVolume(intra=intra, inter=dict(volume.inter))


def with_expert_parallel(dense: CommVolume, experts: CommVolume, exchanged: float, ep: int, *,
                         crosses_nodes: bool = False) -> CommVolume:
    """The step's bytes under expert parallelism of size `ep`: the data-parallel collectives of
    the parameters outside the experts (`dense`) and of the experts over their ranks
    (`experts`), plus all-to-alls whose full buffers total `exchanged` bytes (a rank sends
    (ep-1)/ep of each), across nodes when the ep group spans them."""
    sent = ring_bytes("all_to_all", exchanged, ep)
    if not sent:
        return dense + experts
    exchange = {"all_to_all": sent}
    return dense + experts + CommVolume(**({"inter": exchange} if crosses_nodes else {"intra": exchange}))
