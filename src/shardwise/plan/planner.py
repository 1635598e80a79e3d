"""The planner: which strategy and batch fit, how fast each would run, and the one to pick.

`plan_model` traces every candidate configuration (see `trace.py`), fits the traces (`fit.py`)
and returns a frozen `Plan`. `plan_module` does the same for a module the script already built
(what `Engine(strategy="auto")` calls at `prepare`), and `plan_named` for what the command line
names (a preset, a config.json, module:factory). Each takes one `PlanRequest` (`request.py`).

Step time is an estimate for *comparing* plans, from stated speeds (`Hardware`): compute is the
traced FLOPs (recomputation included) at the device's sustained rate; communication is the
bytes each collective moved in the trace, times the ring factor (all-reduce 2(W-1)/W, all-gather
and reduce-scatter (W-1)/W), over the interconnect's bus bandwidth, overlapped with compute
(the step takes the longer of the two); offload adds its host<->device copies over PCIe and the
host optimizer step, which do not overlap (they happen at the optimizer step).
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..config.tree import STRATEGY_TABLE, ConfigError
from .comm import CommVolume, step_comm, with_expert_parallel, with_tensor_parallel
from .fakes import fake_mode
from .fit import Fitted, GiB, Hardware, Overheads, largest_batch
from .floor import ModelBytes, state_floor
from .load import LoadMemory, load_memory
from .presets import TRACE_DEPTHS, ModelSpec, PlanError, batch_dim, module_spec, resolve_model
from .request import CANDIDATES, PlanRequest, parse_memory
from .trace import Candidate, TraceJob, TraceResult, run_trace

__all__ = ["CANDIDATES", "GlobalBatch", "Plan", "PlanRequest", "StrategyPlan", "parse_memory", "plan_model",
           "plan_module", "plan_named"]

@dataclass(frozen=True, slots=True)
class StrategyPlan:
    """One candidate configuration, predicted at the planned batch and at its largest batch."""

    candidate: Candidate
    batch: int
    """the per-device batch it was evaluated at"""
    fits: bool
    """the peak (and host memory, when a limit is given) fits at `batch`"""
    peak: float
    """predicted per-device peak in bytes: live tensors plus `breakdown["overhead"]`"""
    breakdown: dict[str, float]
    """params, grads, optimizer, activations, comm, temporaries, overhead (bytes on the device)"""
    host: float
    """bytes of host memory each process needs for offloaded state (CUDA targets)"""
    max_batch: int
    """the largest per-device batch that fits (0: not even batch 1)"""
    step_seconds: float
    """estimated seconds per step at `batch` (compute and communication overlapped, + offload)"""
    compute_seconds: float
    comm_seconds: float
    offload_seconds: float
    segment: str
    """where in the step the peak happens (fwd/bwd + position in the stack, opt, zero)"""
    relative_time: float = 1.0
    """step time relative to the fastest plan that fits"""
    why: str = ""
    comm: CommVolume | None = None
    """bytes each rank sends per optimizer step, within a node and across nodes (`plan.comm`)"""
    traced: bool = True
    """False: its optimizer step's floor alone (`floor.state_floor`) is more than the device holds,
    so it fits no batch and was not traced; `peak` and `breakdown` are that lower bound"""

    @property
    def name(self) -> str:
        return self.candidate.name

    def settings(self) -> dict[str, Any]:
        """The `EngineConfig` fields this plan sets."""
        c = self.candidate
        out: dict[str, Any] = {"strategy": c.strategy, "offload": c.offload,
                               "activation_checkpointing": c.activation_checkpointing}
        if c.activation_checkpointing_every is not None:
            out["activation_checkpointing_every"] = c.activation_checkpointing_every
        if c.shard_group_size is not None:  # candidate: data-parallel ranks; config: processes
            out["shard_group_size"] = c.shard_group_size * c.tensor_parallel_size
        if c.tensor_parallel_size > 1:
            out["tensor_parallel_size"] = c.tensor_parallel_size
        if c.sequence_parallel:
            out["sequence_parallel"] = True
        if c.expert_parallel_size > 1:
            out["expert_parallel_size"] = c.expert_parallel_size
        return out


@dataclass(frozen=True, slots=True)
class GlobalBatch:
    """How to reach a global batch: micro-batch x accumulation x devices."""

    global_batch: int
    micro_batch: int
    grad_accum_steps: int
    plan: StrategyPlan
    seconds_per_global_batch: float


@dataclass(frozen=True, slots=True)
class Plan:
    """Every candidate's prediction for one model, world size, device memory and batch."""

    model: str
    parameters: int
    world_size: int
    device: str
    device_memory: int
    host_memory: int | None
    seq_len: int | None
    batch: int
    precision: str
    plans: tuple[StrategyPlan, ...]
    best: StrategyPlan | None
    """the fastest plan that fits at `batch` (None: nothing fits)"""
    why: str
    """one line: why `best` was chosen, or why nothing fits"""
    overheads: Overheads
    hardware: Hardware
    seconds: float
    """how long planning took"""
    global_batch: GlobalBatch | None = None
    traced_depths: tuple[int, ...] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    load: LoadMemory | None = None
    """host memory per process to build and load the model, whole or empty (`plan.load`)"""
    nodes: int = 1
    """nodes the devices spread over (`world_size / nodes` each)"""
    context_parallel_size: int = 1
    """each sequence split over this many devices (`PlanRequest.context_parallel_size`)"""

    @property
    def longest_seq(self) -> dict[Candidate, int]:
        """Under context parallelism: the longest sequence each plan fits at one sequence per
        data-parallel rank, its devices' shares at their largest batch (activations grow with the
        tokens a device holds: tiled, with a fused or blockwise attention, linearly)."""
        if self.seq_len is None:
            return {}
        return {p.candidate: p.max_batch * self.seq_len for p in self.plans}

    def find(
        self, strategy: str, offload: str = "none", activation_checkpointing: str | bool = "none",
        shard_group_size: int | None = None, activation_checkpointing_every: int | None = None,
        tensor_parallel_size: int = 1, sequence_parallel: bool = False, expert_parallel_size: int = 1,
    ) -> StrategyPlan:
        """The plan of one candidate (`shard_group_size`: its hybrid twin; `tensor_parallel_size`:
        its tensor-parallel twin, with `sequence_parallel` or not; `expert_parallel_size`: its
        expert-parallel twin; a bool `activation_checkpointing` is read as full or none)."""
        wanted = Candidate(strategy, offload, activation_checkpointing, shard_group_size,  # type: ignore[arg-type]
                           activation_checkpointing_every, tensor_parallel_size, sequence_parallel,
                           expert_parallel_size)
        for p in self.plans:
            if p.candidate == wanted:
                return p
        raise KeyError(f"no plan for {wanted.name} (shard_group_size={shard_group_size})")


Recompute = tuple[str, int | None]  # an activation-checkpointing mode and its `every`


# -- running the traces --------------------------------------------------------------------------
_PENDING: list[TraceJob] = []


def _run_pending(i: int) -> dict[int, TraceResult]:
    torch.set_num_threads(1)
    try:
        return run_trace(_PENDING[i])
    except ConfigError:  # a one-line refusal (a tp size the model's heads do not divide): as is
        raise
    except BaseException as err:  # some torch errors do not pickle: send the text back
        import traceback

        raise RuntimeError(f"tracing {_PENDING[i].candidate.name} failed:\n{traceback.format_exc()}") from err


def _run_all(jobs: list[TraceJob], workers: int) -> list[dict[int, TraceResult]]:
    """Run traces, in `workers` forked processes when more than one (the command line). Not
    forked where a CUDA device is visible: a fork inherits the parent's CUDA driver state, and
    seen on an H200, a forked trace failed with "CUDA error: initialization error" (the
    optimizer's stream-capture check) after the parent had only asked whether CUDA is
    available, and with "autograd's threading in combination with fork" after a CUDA backward.
    The jobs hold closures, which a spawned process cannot take: there, the traces run in turn."""
    if (workers <= 1 or len(jobs) <= 1 or "fork" not in multiprocessing.get_all_start_methods()
            or torch.cuda.is_available()):
        return [run_trace(j) for j in jobs]
    global _PENDING
    _PENDING = jobs
    pool = multiprocessing.get_context("fork").Pool(workers)
    try:
        results = pool.map(_run_pending, range(len(jobs)), chunksize=1)
        # Workers leave on the pool's sentinels, not on SIGTERM (a `with` block's terminate()):
        # a forked worker inherits the parent's Python signal handlers (an engine's preemption
        # handler, a test runner's), and once terminate() waited for ever on a worker blocked
        # on the task queue's lock that its SIGTERM had not ended (seen once in CI).
        pool.close()
        return results
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
        _PENDING = []


def _batches(batch: int) -> tuple[int, int]:
    return (batch, 2 * batch)


def _trace_candidates(
    spec: ModelSpec,
    candidates: Sequence[Candidate],
    request: PlanRequest,
    *,
    batch: int,
    grad_accum_steps: int,
) -> dict[Candidate, dict[tuple[int | None, int], TraceResult]]:
    """Trace every distinct layout (`layout`) at each traced depth, at `batch` and twice it: the
    traces per candidate keyed by (depth, batch), a candidate sharing its layout's traces."""
    flop_counted: set[Recompute] = set()
    jobs: list[tuple[Candidate, int | None, TraceJob]] = []
    layouts = {c: layout(c, request.world_size) for c in candidates}
    for cand in dict.fromkeys(layouts.values()):  # each distinct layout once, in order
        count = _recompute(cand) not in flop_counted  # FLOPs depend on the recompute only
        flop_counted.add(_recompute(cand))
        cut = trace_depths(cand, spec.depth)
        depths: tuple[int | None, ...] = (None,) if cut is None else cut
        # what CUDA defaults to (foreach) where the optimizer steps on the device
        foreach = True if request.device == "cuda" and not cand.offload_spec.any else None
        for depth in depths:
            job = TraceJob(
                build=functools.partial(spec.build, depth), make_batch=spec.make_batch, loss_fn=spec.loss_fn,
                candidate=cand, world_size=request.world_size, batches=_batches(batch),
                precision=request.precision, foreach=foreach, grad_accum_steps=grad_accum_steps,
                wrap=request.wrap, optimizer=request.optimizer, count_flops=count, target=request.device,
                staging=request.checkpoint_async, local_world_size=request.gpus_per_node,
                tile_tokens=request.tile_tokens if request.context_parallel_size > 1 else None,
            )
            jobs.append((cand, depth, job))
    order = sorted(range(len(jobs)), key=lambda i: -(jobs[i][1] or 0))  # deep traces first: balance
    results = _run_all([jobs[i][2] for i in order], request.workers)
    out: dict[Candidate, dict[tuple[int | None, int], TraceResult]] = {}
    for i, res in zip(order, results):
        cand, depth, _ = jobs[i]
        for b, r in res.items():
            out.setdefault(cand, {})[(depth, b)] = r
    return {c: out[lay] for c, lay in layouts.items()}


def layout(cand: Candidate, world_size: int) -> Candidate:
    """The candidate whose trace stands for `cand`: itself, except where two configurations run
    the same code on the same tensors, so one trace serves both. zero1 on one data-parallel rank
    (world / tensor_parallel_size = 1) without offload: its optimizer shard is the whole
    optimizer and its gather of the updated slices moves nothing, as ddp (traces equal, every
    segment and role, `tests/test_plan_tp.py`)."""
    dp = cand.sizes(world_size).dp
    if dp == 1 and cand.strategy_spec.stage == 1 and not cand.offload_spec.any:
        return replace(cand, strategy=_DDP)
    return cand


_DDP = next(name for name, spec in STRATEGY_TABLE.items() if spec.stage == 0)  # (the replicas' name)


# -- turning traces into plans ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Budget:
    """A checked request with its defaults filled and its memory sizes in bytes."""

    request: PlanRequest
    device: int  # bytes per device
    host: int | None  # bytes of host memory (all processes), if limited
    overheads: Overheads
    hardware: Hardware

    @staticmethod
    def of(request: PlanRequest) -> _Budget:
        """Parse the request's memory sizes and fill its default overheads and speeds."""
        device = parse_memory(request.device_memory, "device memory")
        host = parse_memory(request.host_memory, "host memory") if request.host_memory is not None else None
        hardware = request.hardware or (Hardware() if request.device == "cuda" else Hardware.cpu())
        return _Budget(request, device, host, request.overheads or Overheads(), hardware)


def _evaluate(fitted: Fitted, cand: Candidate, flops: Fitted, budget: _Budget, batch: int) -> StrategyPlan:
    """One candidate's prediction at `batch`, and the largest batch that fits."""
    req, overheads, hardware = budget.request, budget.overheads, budget.hardware
    fixed, frag = overheads.fixed(req.device, req.world_size), overheads.frag(req.device)

    # checkpoint_async: the staged copy of this rank's state lives from a save until its write
    # ends, across the next steps' peaks: host memory beside a GPU, more of the same on a CPU
    staging = fitted.linear("staging", batch) if req.checkpoint_async else 0.0
    on_host = staging if req.device == "cuda" else 0.0

    def need(b: int) -> tuple[float, float, Any]:
        mem = fitted.memory(b)
        return (mem.device + staging - on_host) * (1 + frag) + fixed, mem.host + on_host, mem

    def fits(b: int) -> bool:
        peak, host, _ = need(b)
        return peak <= budget.device and (budget.host is None or host * req.world_size <= budget.host)

    peak, host, mem = need(batch)
    breakdown = dict(mem.roles)
    if staging - on_host:
        breakdown["staging"] = staging - on_host
    breakdown["overhead"] = peak - mem.device - (staging - on_host)
    compute = flops.linear("flops", batch) / hardware.flops(req.precision)
    volume = _volume(fitted, cand, req, batch)
    # one node: the traced collectives over the interconnect; several: the links they cross
    comm = (fitted.comm_seconds(hardware) if req.nodes <= 1 and cand.shard_group_size is None
            else volume.seconds(hardware.interconnect, hardware.inter_node))
    offload = (fitted.linear("offload_bytes", batch) / hardware.pcie
               + fitted.linear("host_optimizer_numel", batch) / hardware.host_adam)
    return StrategyPlan(
        candidate=cand, batch=batch, fits=fits(batch), peak=peak, breakdown=breakdown, host=host,
        max_batch=largest_batch(fits), step_seconds=max(compute, comm) + offload, compute_seconds=compute,
        comm_seconds=comm, offload_seconds=offload, segment=mem.segment, comm=volume,
    )


def _volume(fitted: Fitted, cand: Candidate, req: PlanRequest, batch: int) -> CommVolume:
    """Bytes each rank sends per step, within a node and across nodes (`comm.step_comm`). Under
    tensor parallelism (tp T): the data-parallel collectives over world / T ranks on what one tp
    rank holds (traced: `TraceResult.tp_parameters`), plus the all-reduces the trace counted
    over the T consecutive ranks of the tp group, or with sequence parallelism the all-gathers and
    reduce-scatters that replace them (`with_tensor_parallel`)."""
    tp, ep = cand.tensor_parallel_size, cand.expert_parallel_size
    if ep > 1:
        return _expert_volume(fitted, cand, req, batch)
    if tp == 1:
        return step_comm(cand.strategy, fitted.linear("parameters", batch), req.precision,
                         world_size=req.world_size, nodes=req.nodes, group_size=cand.shard_group_size)
    dp_ranks = cand.sizes(req.world_size).dp
    dp = step_comm(cand.strategy, fitted.linear("tp_parameters", batch), req.precision,
                   world_size=dp_ranks, nodes=req.nodes, group_size=cand.shard_group_size)
    return with_tensor_parallel(dp, fitted.comm_bytes(f"allreduce@{tp}"), tp,
                                gathered=fitted.comm_bytes(f"allgather@{tp}"),
                                scattered=fitted.comm_bytes(f"reduce_scatter@{tp}"))


def _expert_volume(fitted: Fitted, cand: Candidate, req: PlanRequest, batch: int) -> CommVolume:
    """Under expert parallelism of size N (`comm.with_expert_parallel`): the parameters outside
    the experts over every rank (hybrid: within groups of G, across the R = W / G replicas), the
    experts (1/N of them) over the ranks holding the same ones: the G / N edp ranks of a group
    and their R replicas, and the all-to-alls the trace counted (its routing even:
    `fakes.even_routing`). zero2/zero3 shard an experts module over its edp ranks (hybrid: across
    the replicas too, as FSDP's HSDP units do; at N = G only the replicas' all-reduce is left);
    zero1 holds them whole there and all-reduces their gradients over the replicas, then over the
    edp ranks, which share its optimizer step (`expert_parallel.sum_over_replicas`)."""
    ep, world, per_node = cand.expert_parallel_size, req.world_size, req.gpus_per_node
    group = cand.sharding_group(world)
    replicas, edp = world // group, group // ep
    experts = fitted.linear("expert_parameters", batch)
    dense = step_comm(cand.strategy, fitted.linear("parameters", batch) - experts, req.precision,
                      world_size=world, nodes=req.nodes, group_size=cand.shard_group_size)
    spans = group > per_node or per_node % group != 0  # the edp ranks lie in a group spanning nodes
    # (`nodes` below only says which of the experts' rings span nodes: n "nodes" of one rank each)
    if cand.strategy_spec.shards_grads:
        nodes = replicas * edp if spans else replicas if req.nodes > 1 else 1
        held = step_comm(cand.strategy, experts / ep, req.precision, world_size=replicas * edp,
                         group_size=edp, boundary=False, nodes=nodes)
    else:
        held = step_comm(cand.strategy, experts / ep, req.precision, world_size=edp, boundary=False,
                         nodes=edp if spans else 1)
        held = held + step_comm("ddp", experts / ep, req.precision, world_size=replicas, boundary=False,
                                nodes=replicas if req.nodes > 1 else 1)
    exchanged = sum(fitted.comm_bytes(kind) for kind in fitted.comm_kinds() if kind.startswith("alltoall"))
    return with_expert_parallel(dense, held, exchanged, ep, crosses_nodes=ep > per_node)


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _per_sample(p: StrategyPlan) -> float:
    """What plans are compared by: the step time for the same samples. The tp ranks of a tensor-
    parallel plan share one batch, so its step trains world / tp batches, not world: it takes
    tp steps to train what the others train in one."""
    return p.step_seconds * p.candidate.tensor_parallel_size


def _choose(
    plans: list[StrategyPlan], batch: int, budget: int
) -> tuple[list[StrategyPlan], StrategyPlan | None, str]:
    """The plans with their step time relative to the fastest that fits, that one, and why."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        most = max(plans, key=lambda p: (p.max_batch, p.traced, -p.peak))
        hint = (f"; {most.name} fits batch {most.max_batch}" if most.max_batch else
                f"; the smallest, {most.name}, needs {'' if most.traced else 'at least '}{_gib(most.peak)}")
        return plans, None, f"no plan fits batch {batch} in {_gib(budget)} per device{hint}"
    fastest = min(_per_sample(p) for p in fitting)
    plans = [replace(p, relative_time=_per_sample(p) / fastest) for p in plans]
    fitting = [p for p in plans if p.fits]
    best = min(fitting, key=_per_sample)  # ties: the simpler one (listed first)
    others = sorted((p for p in fitting if p is not best), key=_per_sample)
    refused = [p for p in plans if not p.fits and not p.candidate.checkpointed]
    why = (f"{best.name}: the fastest of {len(fitting)} plans that fit batch {batch} "
           f"({_gib(best.peak)} of {_gib(budget)} per device")
    if others:
        why += f"; next {others[0].name} at {others[0].relative_time:.2f}x the step time"
    why += ")"
    if refused:
        verb = " do" if len(refused) > 1 else " does"
        why += "; " + ", ".join(p.name for p in refused[:3]) + verb + " not fit"
    plans = [replace(p, why=why) if p is best else p for p in plans]
    best = next(p for p in plans if p.candidate == best.candidate)
    return plans, best, why


def plan_model(spec: ModelSpec, request: PlanRequest) -> Plan:
    """Trace and fit every candidate of `request` for `spec`; the fastest that fits is `Plan.best`.
    A candidate whose optimizer-step floor alone overflows the device is not traced (`_floored`)."""
    t0 = time.perf_counter()
    request.check()
    budget = _Budget.of(request)
    batch = request.per_device_batch
    cands = request.chosen()
    tp = max(c.tensor_parallel_size for c in cands)
    if tp > 1:
        check_tp_plan(spec, tp)
    ep = max(c.expert_parallel_size for c in cands)
    if ep > 1:
        check_ep_plan(spec, ep)
    with fake_mode():
        whole = spec.build(None)
    sizes = ModelBytes.of(whole)
    floors = {c: state_floor(c, sizes, world_size=request.world_size, device=request.device,
                             adam=request.optimizer is None) for c in cands}
    traced = [c for c in cands if _floor_peak(floors[c], budget) <= budget.device]
    traces = _trace_candidates(spec, traced, request, batch=batch, grad_accum_steps=1) if traced else {}
    fitted = {c: _fit(t, c, spec, request) for c, t in traces.items()}
    flop_src = _flop_sources(fitted, traced)
    plans = [_evaluate(fitted[c], c, flop_src[_recompute(c)], budget, batch) if c in fitted
             else _floored(c, floors[c], budget, batch) for c in cands]
    plans, best, why = _choose(plans, batch, budget.device)
    n_params = sum(p.numel() for p in {id(p): p for p in whole.parameters()}.values())
    accum = None
    if request.global_batch is not None:
        accum = _global_batch(spec, plans, fitted, flop_src, budget)
    return Plan(
        model=spec.name, parameters=n_params, world_size=request.world_size, device=request.device,
        device_memory=budget.device, host_memory=budget.host,
        seq_len=None if spec.seq_len is None else spec.seq_len * request.context_parallel_size, batch=batch,
        precision=request.precision, plans=tuple(plans), best=best, why=why, overheads=budget.overheads,
        hardware=budget.hardware, seconds=time.perf_counter() - t0, global_batch=accum,
        traced_depths=TRACE_DEPTHS if spec.depth is not None else None,
        # tensor and expert parallelism build the model whole on every process (no init_empty yet)
        load=load_memory(whole, [c for c in cands if c.tensor_parallel_size == c.expert_parallel_size == 1],
                         world_size=request.world_size, device=request.device),
        nodes=request.nodes, notes=_depth_notes(traced, spec.depth),
        context_parallel_size=request.context_parallel_size,
    )


def _floor_peak(floor: dict[str, float], budget: _Budget) -> float:
    """The device peak the floor alone makes, with the planner's overheads (as `_evaluate`)."""
    req, o = budget.request, budget.overheads
    return sum(floor.values()) * (1 + o.frag(req.device)) + o.fixed(req.device, req.world_size)


def _floored(cand: Candidate, floor: dict[str, float], budget: _Budget, batch: int) -> StrategyPlan:
    """The plan of a candidate not traced: its floor (parameters, gradients and optimizer state at
    the optimizer step) overflows the device at any batch and in any checkpointing mode."""
    peak = _floor_peak(floor, budget)
    breakdown = {**floor, "overhead": peak - sum(floor.values())}
    return StrategyPlan(
        candidate=cand, batch=batch, fits=False, peak=peak, breakdown=breakdown,
        host=0.0, max_batch=0, step_seconds=0.0, compute_seconds=0.0, comm_seconds=0.0, offload_seconds=0.0,
        segment="opt", traced=False,
    )


def check_tp_plan(spec: ModelSpec, tp: int) -> None:
    """Refuse, in one line, tensor-parallel candidates for a model without a tensor-parallel plan
    (`strategies.tensor_parallel.model_plan`: the model's own, a transformers model's
    `base_model_tp_plan`, or one built in); built on fake tensors, cut to the traced depth."""
    from ..strategies.tensor_parallel import model_plan

    with fake_mode():
        model = spec.build(TRACE_DEPTHS[0] if spec.depth is not None else None)
    if not model_plan(model, None):
        raise PlanError(f"--tensor-parallel-size {tp}: {spec.name} has no tensor-parallel plan (no "
                        "base_model_tp_plan nor a built-in one); plan it without --tensor-parallel-size, or "
                        "give the model a tensor_parallel_plan attribute")


def check_ep_plan(spec: ModelSpec, ep: int) -> None:
    """Refuse, in one line, expert-parallel candidates for a model whose experts the step would
    refuse to split (`expert_parallel.experts_to_split`; built on fake tensors, cut to the traced
    depth)."""
    from ..strategies.expert_parallel import experts_to_split

    with fake_mode():
        model = spec.build(TRACE_DEPTHS[0] if spec.depth is not None else None)
    try:
        experts_to_split(model, ep, f"--expert-parallel-size {ep}", "plan it without --expert-parallel-size")
    except ConfigError as err:
        raise PlanError(str(err)) from None


def trace_depths(cand: Candidate, depth: int | None) -> tuple[int, int] | None:
    """The two depths a model of `depth` blocks is cut to for tracing `cand` (None: traced whole).

    `TRACE_DEPTHS`, except under selective checkpointing of every k-th block: then two
    multiples of k, so that both cuts checkpoint the same share of their blocks (exact at a
    depth that is a multiple of k; within one block's difference otherwise); a model not
    deeper than those is traced whole."""
    if depth is None:
        return None
    k = cand.activation_checkpointing_every or 1
    if k == 1:
        return TRACE_DEPTHS
    low = k * -(-TRACE_DEPTHS[0] // k)
    return (low, low + k) if low + k < depth else None


def _fit(traces: dict[tuple[int | None, int], TraceResult], cand: Candidate, spec: ModelSpec,
         request: PlanRequest) -> Fitted:
    """`cand`'s traces, extrapolated to the model's depth (see `trace_depths`)."""
    cut = trace_depths(cand, spec.depth)
    return Fitted(traces, spec.depth if cut is not None else None, cut or TRACE_DEPTHS, request.world_size,
                  request.device)


def _depth_notes(cands: list[Candidate], depth: int | None) -> tuple[str, ...]:
    """A line for each candidate not traced at `TRACE_DEPTHS` (selective every k-th block)."""
    notes = []
    for c in cands:
        cut = trace_depths(c, depth)
        if depth is not None and cut != TRACE_DEPTHS:
            at = f"{cut[0]} and {cut[1]} blocks" if cut is not None else f"its full {depth} blocks"
            notes.append(f"{c.name}: traced at {at} (every {c.activation_checkpointing_every}th block "
                         "checkpointed)")
    return tuple(notes)


def _recompute(c: Candidate) -> Recompute:
    """What decides the FLOPs a step recomputes: the checkpointing mode (and its `every`)."""
    return c.activation_checkpointing, c.activation_checkpointing_every


def _flop_sources(fitted: dict[Candidate, Fitted], cands: list[Candidate]) -> dict[Recompute, Fitted]:
    """Per recompute setting (`_recompute`), the fit whose traces counted FLOPs (one per setting)."""
    return {ac: next(f for c, f in fitted.items() if _recompute(c) == ac
                     and any(r.flops for r in f.traces.values()))
            for ac in {_recompute(c) for c in cands}}


def _global_batch(spec: ModelSpec, plans: list[StrategyPlan], fitted: dict[Candidate, Fitted],
                  flop_src: dict[Recompute, Fitted], budget: _Budget) -> GlobalBatch | None:
    """Per-device batch and accumulation steps that reach the request's global batch, fastest first.

    Accumulating holds gradients between micro-steps (FSDP keeps them unsharded until the last
    one), so plans that need more than one micro-step are traced again with accumulation.
    """
    req = budget.request
    total, world = int(req.global_batch or 0), req.world_size
    if total % world:
        raise PlanError(f"--global-batch {total} is not a multiple of the {world} devices")
    per_device = total // world
    options: list[GlobalBatch] = []
    needs_accum = [p.candidate for p in plans if p.max_batch < per_device and p.traced]
    accum_fitted: dict[Candidate, Fitted] = {}
    if needs_accum:
        batch = min(max(1, min(p.max_batch for p in plans if p.candidate in needs_accum)), per_device)
        traces = _trace_candidates(spec, needs_accum, req, batch=batch, grad_accum_steps=2)
        accum_fitted = {c: _fit(t, c, spec, req) for c, t in traces.items()}
    for p in (p for p in plans if p.traced):  # the others fit no batch
        c = p.candidate
        flops = flop_src[_recompute(c)]
        if p.max_batch >= per_device:
            micro, steps = per_device, 1
            plan = p if p.batch == micro else _evaluate(fitted[c], c, flops, budget, micro)
        else:
            probe = _evaluate(accum_fitted[c], c, flops, budget, req.per_device_batch)
            if probe.max_batch == 0:
                continue
            steps = -(-per_device // probe.max_batch)
            while per_device % steps:
                steps += 1
            micro = per_device // steps
            plan = _evaluate(accum_fitted[c], c, flops, budget, micro)
        # every micro-step computes; communication and offload happen once per optimizer step
        # (parameters sharded at rest are gathered again on every micro-step: forward and backward)
        regather = (steps - 1) * plan.comm_seconds * 2 / 3 if c.strategy_spec.shards_params else 0.0
        seconds = steps * plan.compute_seconds + plan.comm_seconds + regather + plan.offload_seconds
        options.append(GlobalBatch(total, micro, steps, plan, seconds))
    return min(options, key=lambda o: o.seconds_per_global_batch) if options else None


def plan_named(model: str, request: PlanRequest, *, seq_len: int) -> Plan:
    """`shardwise plan`: the model as a preset name, a config.json path or module:factory.
    Every value is checked before anything is traced."""
    request.check()
    parse_memory(request.device_memory, "--gpu-memory")
    if request.host_memory is not None:
        parse_memory(request.host_memory, "--cpu-memory")
    cp = request.context_parallel_size
    if seq_len % (2 * cp) and cp > 1:
        raise PlanError(f"--seq-len {seq_len} with --context-parallel-size {cp}: the ring splits a sequence "
                        f"into {2 * cp} equal chunks; give a multiple of {2 * cp}")
    spec = resolve_model(model, seq_len)  # (the whole sequence must fit the model's positions)
    return plan_model(spec if cp == 1 else resolve_model(model, seq_len // cp), request)


def plan_module(
    model: nn.Module,
    sample_batch: Any,
    request: PlanRequest,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> Plan:
    """Plan for a module the script built (real parameters are only read for their shapes).

    `sample_batch` is one batch as the DataLoader yields it (dicts, tuples or a tensor); its
    tensors whose first dimension is the batch are resized to `request.batch` (default: the
    sample's). `loss_fn(output, batch)` computes the loss; by default the model's `.loss`
    (a `transformers` model given labels), else the mean of its output. `request.optimizer`
    builds the optimizer to trace (default AdamW). Safe to call inside a running job, on every
    rank (no collective is issued; every rank computes the same plan, traced in this process):
    the job's process group, RNG state and model are left as they were. Call it before
    activation checkpointing is applied to the model.
    """
    spec = module_spec(model, sample_batch, loss_fn=loss_fn, wrap=request.wrap)
    batch = batch_dim(sample_batch) if request.batch is None else request.batch
    return plan_model(spec, replace(request, batch=batch, workers=1))
