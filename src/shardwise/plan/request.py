"""What the planner is asked: one `PlanRequest` (the devices, the batch, the choices to compare),
checked before anything is traced, and the memory sizes it is given in."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from ..config.tree import PRECISIONS, plan_choices, strategy_spec
from .candidate import Candidate, check_checkpointing
from .fit import Hardware, Overheads
from .presets import PlanError


def _candidates() -> tuple[Candidate, ...]:
    """Every (strategy, offload) pair the strategy table allows on the torch backend, without and
    then with (full) activation checkpointing, the simpler first (a tie in step time goes to the first):
    nothing offloaded, then the optimizer, then the parameters on the host, each by ZeRO stage;
    with the optimizer on the host, the plans that keep whole gradients on the device (zero1)
    come after those that shard them: the same host traffic for more device memory."""
    from ..config.tree import offload_spec

    def simpler(choice: tuple[str, str]) -> tuple[bool, bool, bool, int]:
        off, spec = offload_spec(choice[1]), strategy_spec(choice[0])
        whole_grads = off.optimizer_on_host and not spec.shards_grads
        return off.optimizer_on_host, off.params_on_host, whole_grads, spec.stage

    choices = sorted(plan_choices("torch"), key=simpler)
    return tuple(Candidate(s, o, ac) for ac in ("none", "full") for s, o in choices)


CANDIDATES: tuple[Candidate, ...] = _candidates()


def tp_candidates(base: Sequence[Candidate], tp: int, sequence_parallel: bool = False) -> list[Candidate]:
    """The tensor-parallel twins (tp `tp`, with `sequence_parallel` or not) of the candidates in
    `base`: every strategy and offload, each activation-checkpointing mode, and hybrid sharding,
    whose group of G processes (a node) becomes G / tp data-parallel ranks (the tp ranks of a node
    split its layers; `shard_group_size` counts data-parallel ranks under tensor parallelism);
    not where that leaves a group of one rank."""
    out = []
    for c in base:
        if c.tensor_parallel_size != 1:
            continue
        group = None if c.shard_group_size is None else c.shard_group_size // tp
        if group is not None and group < 2:
            continue
        out.append(replace(c, tensor_parallel_size=tp, sequence_parallel=sequence_parallel,
                           shard_group_size=group))
    return out


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_memory(value: str | float, what: str = "memory") -> int:
    """'24GB', '24GiB', '512MB', '1.5T' or a number of bytes -> bytes.

    Memory sizes are binary: GB and GiB both mean 2**30 bytes (a "24 GB" card holds 24 GiB).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise PlanError(f"{what}={value!r}: must be more than 0 bytes")
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise PlanError(f"{what}={value!r} is not a memory size; write e.g. 24GB, 80GiB or 512MB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise PlanError(f"{what}={value!r}: must be more than 0 bytes")
    return size


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """One planning question: which candidates fit these devices at this batch, and how fast."""

    world_size: int
    """devices (processes) to plan for"""
    device_memory: int | str
    """memory of one device: bytes or a size like "24GB" (binary: 24GB = 24 GiB)"""
    batch: int | None = None
    """per-device batch to evaluate (None: 1, or the sample batch's size for `plan_module`)"""
    device: Literal["cuda", "cpu"] = "cuda"
    """"cuda" counts device tensors against `device_memory` (plus `overheads`) and reports
    offloaded state as host memory; "cpu" predicts the live tensor bytes of CPU processes"""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (traced as bf16: the same bytes)"""
    host_memory: int | str | None = None
    """host memory of the machine; plans whose host memory (all processes) exceeds it do not fit"""
    candidates: Sequence[Candidate] | None = None
    """the configurations to compare (None: `CANDIDATES`, every one the strategy table allows)"""
    activation_checkpointing: str | bool | None = None
    """None: plans without and with (full) checkpointing; a mode (none, full, selective, offload):
    only that way, every strategy of `CANDIDATES` planned with it (or, when `candidates` are
    named, those with that mode); True/False: full/none"""
    activation_checkpointing_every: int | None = None
    """with activation_checkpointing="selective": every k-th block checkpointed in full instead"""
    checkpoint_async: bool = False
    """count the host copy of the state that a checkpoint written in the background holds
    (`checkpoint_async`): host memory on cuda, part of the peak on cpu"""
    global_batch: int | None = None
    """suggest per-device batch x accumulation steps that reach this global batch"""
    overheads: Overheads | None = None
    """device memory a trace cannot see (None: `Overheads()`)"""
    hardware: Hardware | None = None
    """stated speeds for the step-time estimate (None: `Hardware()`, or `Hardware.cpu()` on cpu)"""
    wrap: tuple[Any, ...] = ()
    """the blocks to shard by (module classes or names), as `EngineConfig.wrap`"""
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    """builds the optimizer to trace from the parameters (None: AdamW)"""
    workers: int = 1
    """processes tracing in parallel (forked; `plan_module` always traces in its own process)"""
    nodes: int = 1
    """nodes the `world_size` devices spread over, `gpus_per_node` each; with more than one, the
    sharding strategies are also planned hybrid (sharded within a node, replicated across nodes)
    and every plan's communication is split into bytes within a node and across nodes"""
    tensor_parallel_size: int = 1
    """above 1: every plan is also planned with tensor parallelism of this size (the model's planned
    layers split over that many ranks of a node; `Candidate.tensor_parallel_size`; `tp_candidates`)"""
    sequence_parallel: bool = False
    """the tensor-parallel plans with sequence parallelism (`Candidate.sequence_parallel`)"""
    context_parallel_size: int = 1
    """above 1: every plan with each sequence split over this many devices (context parallelism,
    whose devices take the same samples): a device is traced on its share of the tokens (the
    model spec's sequence is that share), with tiled MLP and loss over `tile_tokens` (their
    default under it); parameters shard over every device as without it. Its ring or all-to-all
    traffic is not in the step time."""
    tile_tokens: int = 1024
    """the tiles of the tiled MLP and loss under context parallelism"""
    expert_parallel_size: int = 1
    """above 1: every zero1, zero2 and zero3 plan is also planned with the experts of every
    mixture-of-experts layer split over this many devices (`Candidate.expert_parallel_size`),
    traced with even routing (`fakes.even_routing`); listed after the plans without"""

    @property
    def per_device_batch(self) -> int:
        """The per-device batch evaluated (1 when none was given)."""
        return 1 if self.batch is None else self.batch

    @property
    def gpus_per_node(self) -> int:
        """Devices (processes) on each node."""
        return self.world_size // max(1, self.nodes)

    def chosen(self) -> list[Candidate]:
        """The candidates to trace: those asked for, with activation checkpointing as asked; on
        more than one node (and when none were named) each sharding one also hybrid, its group
        one node, listed right after its full-sharding twin."""
        mode, every = self.checkpointing
        if mode is None:
            base = list(self.candidates or CANDIDATES)
        elif self.candidates is not None:
            base = [c for c in self.candidates if c.activation_checkpointing == mode]
        else:  # every plan without checkpointing, planned with this mode
            base = [replace(c, activation_checkpointing=mode, activation_checkpointing_every=every)
                    for c in CANDIDATES if not c.checkpointed]
        if self.candidates is not None:
            return base
        out: list[Candidate] = []
        for c in base:
            out.append(c)
            if self.nodes > 1 and c.strategy_spec.shards_optimizer and c.shard_group_size is None:
                out.append(replace(c, shard_group_size=self.gpus_per_node))
        if self.tensor_parallel_size > 1:  # after every plan without: a tie goes to the simpler
            out += tp_candidates(list(out), self.tensor_parallel_size, self.sequence_parallel)
        ep = self.expert_parallel_size
        if ep > 1:  # (expert parallelism splits within the sharding group: hybrid where ep divides it)
            out += [replace(c, expert_parallel_size=ep) for c in list(out)
                    if c.strategy_spec.shards_optimizer and (c.shard_group_size or ep) % ep == 0]
        return out

    @property
    def checkpointing(self) -> tuple[str | None, int | None]:
        """The activation-checkpointing mode asked for (None: both none and full) and its `every`."""
        ac = self.activation_checkpointing
        if isinstance(ac, bool):
            ac = "full" if ac else "none"
        return ac, self.activation_checkpointing_every

    def _check_tp(self, tp: Any, flag: str) -> None:
        """A tensor-parallel size: an integer >= 1 that divides the devices of a node (its
        all-reduces stay within a node), and so the world."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise PlanError(f"{flag} {tp!r} must be an integer >= 1 (1: no tensor parallelism)")
        per_node = self.gpus_per_node
        if per_node % tp:
            where = (f"the {self.world_size} devices" if self.nodes <= 1
                     else f"the {per_node} devices per node")
            raise PlanError(f"{flag} {tp} does not divide {where}; choose a divisor of it "
                            "(tensor parallelism stays within a node)")

    def _check_ep(self, world: int) -> None:
        """An expert-parallel size: an integer >= 1 that divides the devices and a hybrid
        candidate's group, planned without tensor or context parallelism
        (`strategies.expert_parallel.check_layout`)."""
        ep = self.expert_parallel_size
        sizes = [ep] + [c.expert_parallel_size for c in self.candidates or ()]
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or world % n:
                raise PlanError(f"--expert-parallel-size {n!r} must be an integer >= 1 that divides the "
                                f"{world} devices")
        if max(sizes) > 1 and (self.tensor_parallel_size > 1 or self.context_parallel_size > 1 or any(
                c.tensor_parallel_size > 1 for c in self.candidates or () if c.expert_parallel_size > 1)):
            raise PlanError("--expert-parallel-size with tensor or context parallelism: the planner plans "
                            "expert parallelism with data parallelism only; plan it alone")
        for c in self.candidates or ():
            if c.expert_parallel_size > 1 and (c.shard_group_size or world) % c.expert_parallel_size:
                raise PlanError(f"{c.name}: expert_parallel_size {c.expert_parallel_size} does not divide "
                                f"the sharding group of {c.shard_group_size}; choose a divisor of it")
            if c.expert_parallel_size > 1 and not c.strategy_spec.shards_optimizer:
                raise PlanError(f"{c.name}: expert parallelism needs zero1, zero2 or zero3 (the experts are "
                                "split over the sharding group)")

    def check(self) -> None:
        """Refuse a bad value in one line, before anything is traced."""
        mode, every = self.checkpointing
        if mode is not None or every is not None:
            check_checkpointing("none" if mode is None else mode, every)
        world, batch, gb = self.world_size, self.per_device_batch, self.global_batch
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise PlanError(f"--gpus {world!r}: plan for at least 1 device")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise PlanError(f"--batch {batch!r}: the per-device batch must be at least 1")
        if self.precision not in PRECISIONS:
            raise PlanError(f"--precision {self.precision!r} is not valid; choose one of: "
                            + ", ".join(PRECISIONS))
        nodes = self.nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise PlanError(f"--nodes {nodes!r}: plan for at least 1 node")
        if world % nodes:
            raise PlanError(f"--gpus {world} does not spread evenly over --nodes {nodes}; "
                            "give --nodes and --gpus-per-node instead")
        self._check_tp(self.tensor_parallel_size, "--tensor-parallel-size")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise PlanError("--sequence-parallel splits the activations over the tensor-parallel ranks: give "
                            "--tensor-parallel-size N (N > 1) with it")
        for c in self.candidates or ():
            group, dp = c.shard_group_size, world // max(1, c.tensor_parallel_size)
            self._check_tp(c.tensor_parallel_size, f"{c.name}: tensor_parallel_size")
            if group is not None and (group < 1 or dp % group):
                what = "devices" if c.tensor_parallel_size == 1 else "data-parallel ranks"
                raise PlanError(f"shard_group_size={group} does not divide the {dp} {what}")
            if c.sequence_parallel and c.tensor_parallel_size == 1:
                raise PlanError(f"{c.name}: sequence_parallel needs tensor_parallel_size above 1")
        cp = self.context_parallel_size
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world % cp:
            raise PlanError(f"--context-parallel-size {cp!r} must be an integer >= 1 that divides the "
                            f"{world} devices")
        if cp > 1 and self.tensor_parallel_size > 1:
            raise PlanError("--context-parallel-size with --tensor-parallel-size: the planner plans one of "
                            "them at a time")
        self._check_ep(world)
        if self.device not in ("cuda", "cpu"):
            raise PlanError(f"device {self.device!r} is not valid; choose cuda or cpu")
        if gb is not None and (not isinstance(gb, int) or gb < 1):
            raise PlanError(f"--global-batch {gb!r} must be at least 1")
