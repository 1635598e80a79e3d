"""Bytes each rank sends per optimizer step within its node and across nodes, full vs hybrid
sharding, measured on real processes; then the step time with a slow link between the nodes.

    python benchmarks/comm.py                       # 4 CPU processes as 2 simulated nodes x 2
    python benchmarks/comm.py --modes full          # full sharding only

The script starts `--nodes x --gpus-per-node` gloo processes itself; ranks 0..G-1 are node 0,
the next G node 1, and so on (LOCAL_WORLD_SIZE=G, so `shard_group_size="node"` means G). For
zero2 and zero3, fully sharded (one group of all processes) and hybrid (`shard_group_size:
node`), it trains the benchmarks' GPT and:

1. **Counts** every collective of one optimizer step by wrapping the c10d `ProcessGroup`
   methods that torch.distributed and FSDP2 call (`all_gather_single`, `reduce_scatter_single`,
   `allreduce`, and the other gather/scatter/reduce/broadcast methods): the kind, the group's
   ranks and the tensors' sizes. A collective is *inter-node* when its group's ranks lie on two
   or more nodes. Bytes sent per rank are a ring algorithm's for that call (all-gather and
   reduce-scatter (g-1)/g of the full buffer, all-reduce 2(g-1)/g; `shardwise.plan.comm`).
   On gloo, shardwise reduce-scatters gradients as an in-place all-reduce (`strategies/fsdp.py`,
   faster than gloo's emulated reduce-scatter); the table counts such a call as the
   reduce-scatter it stands for (what NCCL would send) and the JSON keeps the all-reduce's own
   bytes as `wire`. DDP's reducer calls c10d from C++ and is not seen, so zero1/ddp are not offered.
2. **Times** steps without delay and with a delay injected into every inter-node collective:
   the issuing process sleeps bytes / `--link-gbps` before the call (a slow network between the
   nodes; it blocks, so no overlap with compute: the worst case for full sharding).

Prints a table and writes benchmarks/results/comm-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, RESULTS, lm_loss, write_report

from shardwise.plan.comm import ring_bytes

# c10d ProcessGroup methods -> the kind of collective; which argument holds the sizes
_METHODS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather", "allgather": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_single_coalesced": "all_gather",
    "_allgather_base": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_single_coalesced": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "alltoall_base": "all_to_all",
}
MODES = {"full": None, "hybrid": "node"}


def _nbytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (a tensor or nested lists of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return 0


def _full_buffer(kind: str, args: tuple[Any, ...], group: int) -> int:
    """The collective's full buffer: the gathered output, the reduce-scatter input, the tensor."""
    if kind == "all_gather":
        return group * _nbytes(args[1])  # each rank's input, G of them
    if kind == "reduce_scatter":
        return group * _nbytes(args[0])  # each rank's output, G of them
    return _nbytes(args[0])


class Meter:
    """Wraps the c10d collectives of this process: records and (optionally) delays them."""

    def __init__(self, per_node: int) -> None:
        self.per_node = per_node
        self.recording = False
        self.records: list[dict[str, Any]] = []
        self.link: float | None = None  # bytes/s of the simulated inter-node link (None: no delay)
        self._standing_for = threading.local()

    def install(self) -> None:
        """Replace each ProcessGroup method by a recording wrapper (once per process)."""
        pg_class = dist.ProcessGroup
        for name, kind in _METHODS.items():
            original = getattr(pg_class, name, None)
            if original is not None:
                setattr(pg_class, name, self._wrap(kind, original))

    def _wrap(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        meter = self

        def collective(pg: Any, *args: Any, **kwargs: Any) -> Any:
            ranks = dist.get_process_group_ranks(pg)
            size = len(ranks)
            inter = len({r // meter.per_node for r in ranks}) > 1
            full = _full_buffer(kind, args, size)
            logical = getattr(meter._standing_for, "kind", None) or kind
            sent = ring_bytes(logical, full, size)
            if meter.recording:
                meter.records.append({"kind": logical, "called": kind, "group": size, "inter": inter,
                                      "bytes": sent, "wire": ring_bytes(kind, full, size)})
            if inter and meter.link is not None and sent:
                time.sleep(sent / meter.link)
            return original(pg, *args, **kwargs)

        return collective

    @contextmanager
    def standing_for(self, kind: str) -> Iterator[None]:
        """Collectives issued inside count as one `kind` (the all-reduce behind a reduce-scatter)."""
        self._standing_for.kind = kind
        try:
            yield
        finally:
            self._standing_for.kind = None

    def install_reduce_scatter(self) -> None:
        """Mark the all-reduce shardwise issues for FSDP2's reduce-scatter on gloo as one."""
        from shardwise.strategies import fsdp

        original = fsdp.gloo_reduce_scatter
        meter = self
        patched: set[type] = set()

        def traced(mesh: Any) -> Any:
            comm = original(mesh)
            cls = type(comm)
            if comm is not None and cls not in patched:
                call = cls.__call__

                def counted(obj: Any, *args: Any, **kwargs: Any) -> Any:
                    with meter.standing_for("reduce_scatter"):
                        return call(obj, *args, **kwargs)

                cls.__call__ = counted  # type: ignore[method-assign]
                patched.add(cls)
            return comm

        fsdp.gloo_reduce_scatter = traced

    def summary(self) -> dict[str, Any]:
        """Bytes sent per rank, by link (intra/inter) and kind, and the calls seen."""
        out: dict[str, Any] = {"intra": {}, "inter": {}, "wire": {"intra": 0.0, "inter": 0.0}, "calls": {}}
        for r in self.records:
            scope = "inter" if r["inter"] else "intra"
            out[scope][r["kind"]] = out[scope].get(r["kind"], 0.0) + r["bytes"]
            out["wire"][scope] += r["wire"]
            key = f"{r['called']} g{r['group']} {scope}"
            out["calls"][key] = out["calls"].get(key, 0) + 1
        return out


def _model(tiny: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=256, d=64, layers=2, heads=2) if tiny else GPT()


class _Case:
    """One prepared engine, model and optimizer (full or hybrid) and its batches."""

    def __init__(self, strategy: str, mode: str, args: argparse.Namespace) -> None:
        import shardwise

        self.engine = shardwise.Engine(preempt_signals=(),
                                       strategy=strategy, shard_group_size=MODES[mode], seed=0,
                                       progress=False, cpu=True)
        model = _model(args.tiny)
        self.parameters = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.model, self.opt = self.engine.prepare(model, opt)
        vocab, seq = (256, 33) if args.tiny else (4096, 129)
        g = torch.Generator().manual_seed(self.engine.process_index)
        self.batches = [torch.randint(0, vocab, (args.batch_size, seq), generator=g) for _ in range(2)]

    def step(self, i: int) -> float:
        """One optimizer step on batch i (mod 2); its seconds, from a barrier."""
        dist.barrier()
        t0 = time.perf_counter()
        self.engine.backward(lm_loss(self.model, self.batches[i % 2]))
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0


def _run_strategy(meter: Meter, strategy: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Count one step's collectives per mode, then time the modes in alternating order (load
    drift on a shared machine hits both), without delay and at each simulated link speed."""
    cases = {m: _Case(strategy, m, args) for m in args.modes}
    rows: dict[str, dict[str, Any]] = {}
    for mode, case in cases.items():
        case.step(0)  # warm up
        meter.records, meter.recording = [], True
        case.step(1)
        meter.recording = False
        rows[mode] = {"parameters": case.parameters, **meter.summary(), "step_s": {}, "step_min_s": {},
                      "delay_s": {}}
        groups = {int(k.split(" g")[1].split()[0]) for k in rows[mode]["calls"]}
        world = case.engine.num_processes
        if mode == "hybrid" and world // args.gpus_per_node > 1 and groups == {world}:
            raise RuntimeError("shard_group_size='node' ran full sharding: hybrid sharding is not "
                               "implemented by the strategies in this tree; run with --modes full")
    for link in [None, *args.link_gbps]:
        key = "none" if link is None else f"{link:g}"
        meter.link = None if link is None else link * 1e9
        times: dict[str, list[float]] = {m: [] for m in cases}
        for r in range(args.steps):
            for mode in list(cases) if r % 2 == 0 else list(cases)[::-1]:
                times[mode].append(cases[mode].step(r))
        for mode, row in rows.items():
            row["step_s"][key] = statistics.median(times[mode])
            row["step_min_s"][key] = min(times[mode])
            row["delay_s"][key] = 0.0 if link is None else sum(row["inter"].values()) / (link * 1e9)
    meter.link = None
    return rows


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    world = args.nodes * args.gpus_per_node
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % args.gpus_per_node),
                      LOCAL_WORLD_SIZE=str(args.gpus_per_node), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    code = 0
    try:
        meter = Meter(args.gpus_per_node)
        meter.install()
        meter.install_reduce_scatter()
        rows = {f"{s} {m}": row for s in args.strategies for m, row in _run_strategy(meter, s, args).items()}
        Path(out, f"{rank}.json").write_text(json.dumps(rows))
        dist.barrier()
    except BaseException:  # noqa: BLE001 -- the parent reports it
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    os._exit(code)  # gloo's teardown can hang at exit (see ../shared notes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank's rows, after running all cases on `nodes x gpus_per_node` processes."""
    world = args.nodes * args.gpus_per_node
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shardwise-comm-") as out:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, args, port, out)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = sorted(Path(out).glob("*.err"))
        if errors:
            raise RuntimeError(f"rank {errors[0].stem} failed:\n{errors[0].read_text()}")
        missing = [r for r in range(world) if not Path(out, f"{r}.json").exists()]
        if missing:
            raise RuntimeError(f"ranks {missing} gave no result within {args.timeout} s")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def _mib(x: float) -> str:
    return f"{x / 2**20:8.2f}"


def table(rows: dict[str, dict[str, Any]], links: list[float]) -> str:
    """The per-rank table: MiB sent within / across nodes per kind, and step times."""
    speeds = ["no delay", *[f"@{x:g}GB/s" for x in links]]
    head = (f"{'case':14s} {'intra MiB':>9s} {'inter MiB':>9s}  {'AG in/out':>17s} {'RS in/out':>17s} "
            f"{'AR in/out':>17s} " + "".join(f" {s + ' s':>13s}" for s in speeds))
    lines = [head, "-" * len(head)]
    for case, r in rows.items():
        intra, inter = r["intra"], r["inter"]
        per_kind = " ".join(f"{_mib(intra.get(k, 0.0))}/{_mib(inter.get(k, 0.0))}"
                            for k in ("all_gather", "reduce_scatter", "all_reduce"))
        sent = f"{_mib(sum(intra.values())):>9s} {_mib(sum(inter.values())):>9s}"
        keys = ["none", *[f"{x:g}" for x in links]]
        times = "".join(f" {r['step_s'][k]:6.3f}/{r['step_min_s'][k]:6.3f}" for k in keys)
        lines.append(f"{case:14s} {sent}  {per_kind} {times}")
    lines.append("step times: median/min seconds per optimizer step")
    return "\n".join(lines)


def speedups(rows: dict[str, dict[str, Any]], strategies: list[str], links: list[float]) -> dict[str, Any]:
    """Full / hybrid step time per strategy and link speed, of the medians and of the minima
    (> 1: hybrid is faster)."""
    out: dict[str, Any] = {}
    for s in strategies:
        full, hyb = rows.get(f"{s} full"), rows.get(f"{s} hybrid")
        if full and hyb:
            out[s] = {k: {"median": full["step_s"][k] / hyb["step_s"][k],
                          "min": full["step_min_s"][k] / hyb["step_min_s"][k]}
                      for k in ["none", *[f"{x:g}" for x in links]]}
    return out


def main(argv: list[str] | None = None) -> Path:
    """Run, print the table and write the JSON; returns its path."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    ap.add_argument("--gpus-per-node", type=int, default=2, help="processes per simulated node (default 2)")
    ap.add_argument("--strategies", nargs="+", default=["zero2", "zero3"], choices=["zero2", "zero3"])
    ap.add_argument("--modes", nargs="+", default=["full", "hybrid"], choices=list(MODES))
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[1.0, 0.05],
                    help="simulated inter-node link speeds in GB/s per process (default 1 and 0.05)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case and link (default 8)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a 0.1M-parameter GPT (tests)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    ranks = measure(args)
    rows = ranks[0]
    for r, other in enumerate(ranks[1:], 1):  # every rank sends the same bytes (equal shards)
        for case, row in other.items():
            if (row["intra"], row["inter"]) != (rows[case]["intra"], rows[case]["inter"]):
                raise RuntimeError(f"{case}: rank {r} sent other bytes than rank 0: {row} vs {rows[case]}")
    print(f"{args.nodes} simulated nodes x {args.gpus_per_node} CPU processes, gloo; per rank per optimizer "
          f"step; MiB sent within a node / across nodes (ring algorithm per call)")
    print(table(rows, args.link_gbps))
    gains = speedups(rows, args.strategies, args.link_gbps)
    for s, g in gains.items():
        print(f"{s}: full / hybrid step time (median, min): " + ", ".join(
            f"{v['median']:.2f}x, {v['min']:.2f}x" + (" with no delay" if k == "none" else f" at {k} GB/s")
            for k, v in g.items()))
    world = args.nodes * args.gpus_per_node
    cmd = "python benchmarks/comm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    model = "GPT d64 L2 vocab256 seq32" if args.tiny else "GPT d256 L4 vocab4096 seq128 (tied embeddings)"
    path = write_report("comm", {
        "command": cmd.strip(), "world_size": world, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
        "model": model, "batch_per_rank": args.batch_size, "link_gbps": args.link_gbps, "rows": rows,
        "hybrid_speedup": gains,
    }, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
