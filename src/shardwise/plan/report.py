"""A plan as text (the `shardwise plan` table), as a stacked-bar chart, and as a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.tree import ConfigError, EngineConfig
from .fit import GiB
from .planner import Plan, StrategyPlan

PARTS = ("params", "grads", "optimizer", "activations", "comm", "temporaries", "overhead")
_HEAD = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ", "comm": "comm",
         "temporaries": "temp", "overhead": "overhd", "staging": "stage"}


def _parts(plan: Plan) -> tuple[str, ...]:
    """The peak's parts shown: `staging` (checkpoint_async on a CPU target) only when planned."""
    return (*PARTS, "staging") if any(p.breakdown.get("staging") for p in plan.plans) else PARTS


_UNIT = {"GiB": GiB, "MiB": 2**20}


def _unit(plan: Plan) -> str:
    return "GiB" if plan.device_memory >= 4 * GiB else "MiB"


def _g(x: float, unit: str = "GiB") -> str:
    return f"{x / _UNIT[unit]:.1f}"


def _size(x: float) -> str:
    if x >= 1e9:
        return f"{x / 1e9:.2f}B"
    return f"{x / 1e6:.1f}M"


def _peak(p: StrategyPlan, unit: str) -> str:
    """The peak, or for a plan not traced its floor, a lower bound (">X")."""
    return _g(p.peak, unit) if p.traced else ">" + _g(p.peak, unit)


def _part(p: StrategyPlan, part: str, unit: str) -> str:
    """One part of the peak; of a plan not traced, only the parts its floor knows."""
    if not p.traced and part not in p.breakdown:
        return "-"
    return _g(p.breakdown.get(part, 0.0), unit)


def describe(plan: Plan) -> str:
    """The table `shardwise plan` prints: one row per candidate, the choice and why."""
    u = _unit(plan)
    mem = f"{plan.world_size} x {_g(plan.device_memory, u)} {u} ({plan.device})"
    seq = f", seq {plan.seq_len}" if plan.seq_len else ""
    lines = [f"{plan.model} ({_size(plan.parameters)} parameters){seq}, batch {plan.batch} per device, "
             f"{mem}, {plan.precision}"]
    if plan.traced_depths:
        lines.append(f"traced on fake tensors at {plan.traced_depths[0]} and {plan.traced_depths[1]} "
                     f"blocks and batches {plan.batch}, {2 * plan.batch}; "
                     f"extrapolated ({plan.seconds:.1f} s)")
    else:
        lines.append(f"traced on fake tensors at batches {plan.batch}, {2 * plan.batch} "
                     f"({plan.seconds:.1f} s)")
    lines.append("")
    nodes = plan.nodes > 1
    w = max([30] + [len(p.name) for p in plan.plans])
    parts = _parts(plan)
    longest = plan.longest_seq if plan.context_parallel_size > 1 else {}
    head = (f"{'plan':{w + 1}s} {'fits':>4s} {'peak':>6s} " + " ".join(f"{_HEAD[p]:>6s}" for p in parts)
            + f" {'host':>6s} {'max batch':>9s} {'step':>6s}"
            + (f" {'intra':>6s} {'inter':>6s}" if nodes else "")
            + (f" {'longest seq':>11s}" if longest else ""))
    lines += [head, "-" * len(head)]
    for p in plan.plans:
        mark = "*" if plan.best is not None and p.candidate == plan.best.candidate else " "
        sent = f" {_g(p.comm.intra_bytes, u):>6s} {_g(p.comm.inter_bytes, u):>6s}" if nodes and p.comm else ""
        lines.append(
            f"{mark}{p.name:{w}s} {'yes' if p.fits else 'no':>4s} {_peak(p, u):>6s} "
            + " ".join(f"{_part(p, k, u):>6s}" for k in parts)
            + f" {_g(p.host, u) if p.traced else '-':>6s} {p.max_batch:>9d} "
            + (f"{p.relative_time:>5.2f}x" if p.fits else f"{'-':>6s}")  # a time only where it runs
            + sent
            + (f" {longest[p.candidate]:>11d}" if longest else "")
        )
    lines.append("")
    lines.append(f"{u} per device at the planned batch (peak = the parts + overhead); host = host memory per "
                 "process; step = estimated time relative to the fastest plan that fits")
    if not all(p.traced for p in plan.plans):
        lines.append(">X = not traced, at least X: its parameters, gradients and optimizer state alone, held "
                     "at the optimizer step, overflow the device at any batch")
    if longest:
        cp, tokens = plan.context_parallel_size, plan.seq_len or 0
        lines.append(f"context parallelism {cp}: each sequence of {tokens} tokens split over {cp} devices, "
                     f"each traced on its {tokens // cp} tokens with tiled MLP and loss (its ring or "
                     "all-to-all traffic is not in the step time; the ring, context_parallel's default, "
                     "holds up to 5 fp32 batch x heads x (seq/2N)^2 block scores more than traced, Ulysses "
                     "none); longest seq = the longest sequence a plan's memory fits at one per "
                     "data-parallel rank (max batch x seq; the model's positions may allow fewer)")
    if any(p.candidate.tensor_parallel_size > 1 for p in plan.plans):
        lines.append("tp N = the planned layers split over N devices of a node, which share one batch: its "
                     "step is compared per sample (N steps train what the others train in one)")
    moe = [p for p in plan.plans if p.candidate.expert_parallel_size > 1 and p.comm is not None]
    if moe:
        sent = ", ".join(f"{p.name} {_g(_all_to_all(p.comm), u)}" for p in moe
                         if p.comm is not None and not p.candidate.checkpointed)
        lines.append("ep N = every mixture-of-experts layer's experts split over N devices, each token sent "
                     "to the devices of its experts and back (traced with even routing: a skewed router "
                     f"moves and computes more on its busiest device); all-to-all {u} each device sends per "
                     "step: " + sent)
    if nodes:
        lines += _hybrid_lines(plan, u)
    if plan.device == "cuda":
        o = plan.overheads
        lines.append(f"overhead = CUDA context {_g(o.cuda_context, u)} {u}"
                     + (f" + NCCL buffers {_g(o.nccl_buffers, u)} {u}" if plan.world_size > 1 else "")
                     + f" + allocator fragmentation {o.fragmentation:.0%} of the tensor peak")
    lines.append(("best: " if plan.best is not None else "") + plan.why)
    if plan.load is not None:
        ld = plan.load
        plain = [p for p in plan.plans if p.candidate in ld.init and not p.candidate.checkpointed]
        each = ", ".join(f"{p.name} {_g(ld.init[p.candidate], u)} / {_g(ld.load[p.candidate], u)}"
                         for p in plain)
        lines.append(f"host memory per process to build the model: {_g(ld.whole, u)} {u} built whole on "
                     "every process; under engine.init_empty(), initialized / loaded by "
                     f"engine.from_pretrained: {each} {u}")
    if plan.global_batch is not None:
        g = plan.global_batch
        lines.append(f"global batch {g.global_batch} = {g.micro_batch} per device x {g.grad_accum_steps} "
                     f"accumulation step(s) x {plan.world_size} device(s), with {g.plan.name}")
    lines += list(plan.notes)
    return "\n".join(lines)


def _all_to_all(volume: Any) -> float:
    """Bytes a plan's all-to-alls send per step and device (expert parallelism)."""
    return float(volume.intra.get("all_to_all", 0.0) + volume.inter.get("all_to_all", 0.0))


def _hybrid_lines(plan: Plan, u: str) -> list[str]:
    """What the intra/inter columns mean, and per sharding strategy whether hybrid wins."""
    hw = plan.hardware
    per_node = plan.world_size // plan.nodes
    lines = [f"{plan.nodes} nodes x {per_node} devices; hybrid G = sharded within a group of G "
             "(one node; with tp N, G data-parallel ranks of N devices each), replicated across nodes; "
             f"intra / inter = {u} each rank sends per optimizer "
             f"step within a node / across nodes (links: {hw.interconnect / 1e9:g} / "
             f"{hw.inter_node / 1e9:g} GB/s per process)"]
    for p in plan.plans:
        c = p.candidate
        if c.shard_group_size is None or c.offload_spec.any or c.checkpointed:
            continue
        try:  # its twin sharding over all data-parallel ranks (with the same tensor parallelism)
            full = plan.find(c.strategy, tensor_parallel_size=c.tensor_parallel_size,
                             sequence_parallel=c.sequence_parallel)
        except KeyError:
            continue
        if full.comm is None or p.comm is None or not (p.traced and full.traced):
            continue
        t_full = full.comm.seconds(hw.interconnect, hw.inter_node)
        t_hyb = p.comm.seconds(hw.interconnect, hw.inter_node)
        mem = p.peak - full.peak
        if t_hyb < t_full:
            verdict = f"hybrid wins: {t_full / max(t_hyb, 1e-12):.1f}x less communication time"
        else:
            verdict = "full sharding wins: the inter-node link is fast enough"
        lines.append(f"{c.strategy}: full sends {_g(full.comm.inter_bytes, u)} {u} across nodes per rank "
                     f"({t_full * 1e3:.1f} ms), hybrid {_g(p.comm.inter_bytes, u)} {u} "
                     f"({t_hyb * 1e3:.1f} ms) for {_g(mem, u)} {u} more per device: {verdict}")
    return lines


def plot(plan: Plan, path: str | Path) -> None:
    """Stacked bars of the per-device breakdown, one per plan, with the memory limit drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(plan.plans)), 5))
    names = [p.name.replace(" + ", "\n+ ") for p in plan.plans]
    bottom = [0.0] * len(plan.plans)
    for part in _parts(plan):
        values = [p.breakdown.get(part, 0.0) / _UNIT[_unit(plan)] for p in plan.plans]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    u = _unit(plan)
    ax.axhline(plan.device_memory / _UNIT[u], color="black", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, plan.device_memory / _UNIT[u], f" {_g(plan.device_memory, u)} {u}",
            va="bottom", ha="right")
    ax.set_ylabel(f"{u} per device")
    ax.set_title(f"{plan.model}: batch {plan.batch} per device on {plan.world_size} x "
                 f"{_g(plan.device_memory, u)} {u}")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_config(plan: Plan, path: str | Path, chosen: StrategyPlan | None = None) -> None:
    """The chosen plan as a shardwise YAML `shardwise launch` reads (refuses if nothing fits)."""
    from ..config.files import write_yaml

    if chosen is None:  # the global-batch suggestion when asked for one, else the best plan
        chosen = plan.global_batch.plan if plan.global_batch is not None else plan.best
    if chosen is None:
        raise ConfigError(f"nothing to write: {plan.why}")
    accum = 1
    batch = chosen.batch
    g = plan.global_batch
    if g is not None and g.plan.candidate == chosen.candidate:
        batch, accum = g.micro_batch, g.grad_accum_steps
    settings: dict[str, Any] = dict(chosen.settings(), precision=plan.precision, micro_batch_size=batch,
                                    grad_accum_steps=accum,
                                    launch={"num_processes": plan.world_size // plan.nodes,
                                            "num_nodes": plan.nodes})
    if plan.context_parallel_size > 1:
        settings["context_parallel_size"] = plan.context_parallel_size
    cfg = EngineConfig.of(**settings)
    u = _unit(plan)
    header = (f"# written by shardwise plan for {plan.model}: {chosen.name}, predicted peak "
              f"{_g(chosen.peak, u)} of {_g(plan.device_memory, u)} {u} per device\n")
    write_yaml(cfg, path, header=header)
