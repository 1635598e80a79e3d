"""shardwise's two backends side by side: backend="torch" (FSDP2 / DDP + our ZeRO-1) against
backend="deepspeed" (DeepSpeed ZeRO), the same loop and model, each stage, in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/engines.py --models 4m 100m

Models: "4m" (GPT d256, 4 layers, vocab 4096, block 128, batch 4 per process) and "100m" (GPT
d768, 12 layers, vocab 32000, block 256, batch 1 per process), where compute dominates. For each
model and stage (and offload setting) both backends train the same GPT (same seed, data, AdamW,
clipping) through the same shardwise script; only `backend=` differs. Rounds alternate which
backend goes first; each round times --steps steps after --warmup. --warmup-rounds untimed rounds
of both backends come first (the first engine a process builds pays for the process's first
allocations and would bias whichever backend goes first). Reported per rank: the median
step time over all rounds, the spread (lowest and highest per-round median), tokens/s, tensor
memory counted the same way for both (compare.py's census: every live tensor storage after a
step, plus what autograd saves for backward), the final loss, and the ratios deepspeed / torch.
Results go to benchmarks/results/engines-<hw>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, hardware, write_report
from compare import MODEL, Peer, measure, shardwise_peer

import shardwise

SETUPS = ["zero1", "zero2", "zero3", "zero2+optimizer", "zero3+optimizer", "zero3+params"]
MODELS = {  # name -> (GPT sizes, batch per process)
    "4m": ({"vocab": 4096, "d": 256, "layers": 4, "heads": 4, "block": 128}, 4),
    "100m": ({"vocab": 32000, "d": 768, "layers": 12, "heads": 12, "block": 256}, 1),
}


def engine_peer(backend: str, setup: str, deepspeed_config: str | None = None) -> Peer:
    """compare.py's shardwise peer on one engine (`setup` is strategy[+offload]); `deepspeed_config`:
    a DeepSpeed JSON whose zero_optimization tuning keys the deepspeed backend takes."""
    strategy, _, offload = setup.partition("+")
    extra = {"deepspeed_config": deepspeed_config} if backend == "deepspeed" and deepspeed_config else {}
    peer = shardwise_peer(strategy, offload or "none", backend, **extra)
    peer.name = backend
    return peer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["4m"])
    ap.add_argument("--setups", nargs="+", default=SETUPS, help="strategy[+offload] per row")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="rounds, alternating which backend goes first")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds of both backends first")
    ap.add_argument("--deepspeed-config", default=None,
                    help="a DeepSpeed JSON for the deepspeed backend's tuning keys, e.g. DeepSpeed's own "
                         'zero3 reuse distance: {"zero_optimization": {"stage3_max_reuse_distance": 1e9}}')
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    shardwise.Engine(preempt_signals=(), seed=0)  # joins the process group both backends share
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = []
    for name in args.models:
        sizes, batch = MODELS[name]
        MODEL.clear()
        MODEL.update(sizes)  # what compare's peers build
        g = torch.Generator().manual_seed(1000 + rank)
        n = args.warmup + args.steps + 1  # + the memory-census step
        batches = [
            torch.randint(0, MODEL["vocab"], (batch, MODEL["block"] + 1), generator=g).to(device)
            for _ in range(n)
        ]
        tokens = batch * MODEL["block"] * world
        for setup in args.setups:
            runs: dict[str, list[dict[str, Any]]] = {"torch": [], "deepspeed": []}
            for r in range(-args.warmup_rounds, args.rounds):
                for b in (("torch", "deepspeed") if r % 2 == 0 else ("deepspeed", "torch")):
                    result = measure(
                        lambda b=b: engine_peer(b, setup, args.deepspeed_config), batches, args.warmup
                    )
                    if r >= 0:
                        runs[b].append(result)
            rows.append(_row(name, setup, runs, tokens))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        _write(rows, args, world)
    dist.barrier()
    dist.destroy_process_group()


def _row(model: str, setup: str, runs: dict[str, list[dict[str, Any]]], tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "setup": setup}
    med = {}
    for b, rs in runs.items():
        steps = [t for r in rs for t in r["step_times"]]
        med[b] = statistics.median(steps)
        per_round = [statistics.median(r["step_times"]) for r in rs]
        out[f"{b}_ms"] = round(med[b] * 1e3, 1)
        out[f"{b}_spread_ms"] = [round(min(per_round) * 1e3, 1), round(max(per_round) * 1e3, 1)]
        out[f"{b}_tokens_per_s"] = round(tokens / med[b])
        out[f"{b}_mib"] = rs[0]["tensor_mib"]
        out[f"{b}_state_mib"] = rs[0]["state_mib"]
        out[f"{b}_loss"] = rs[0]["final_loss"]
    out["time_ratio"] = round(med["deepspeed"] / med["torch"], 3)  # > 1: the torch backend is faster
    out["memory_ratio"] = round(out["deepspeed_mib"] / out["torch_mib"], 3)
    return out


def _write(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    import datetime

    stem = f"engines-{hardware()}-{datetime.date.today().isoformat()}"
    path = write_report("engines", {
        "command": f"python -m torch.distributed.run --standalone --nproc-per-node {world} "
                   "benchmarks/engines.py " + " ".join(sys.argv[1:]),
        "world_size": world, "models": {m: MODELS[m] for m in args.models}, "steps": args.steps,
        "warmup": args.warmup, "rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
        "deepspeed_config": (
            json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else None
        ),
        "rows": rows,
    }, args.out)
    lines = [
        "| model | setup | torch ms/step (spread) | deepspeed ms/step (spread) | ds/torch time "
        "| torch MiB/rank (state) | deepspeed MiB/rank (state) | memory ratio | final loss torch / ds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ts, ds = r["torch_spread_ms"], r["deepspeed_spread_ms"]
        lines.append(f"| {r['model']} | {r['setup']} | {r['torch_ms']:.0f} ({ts[0]:.0f}-{ts[1]:.0f}) | "
                     f"{r['deepspeed_ms']:.0f} ({ds[0]:.0f}-{ds[1]:.0f}) | {r['time_ratio']:.2f} | "
                     f"{r['torch_mib']} ({r['torch_state_mib']}) | "
                     f"{r['deepspeed_mib']} ({r['deepspeed_state_mib']}) | "
                     f"{r['memory_ratio']:.2f} | {r['torch_loss']:.4f} / {r['deepspeed_loss']:.4f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path} and {stem}.md")


if __name__ == "__main__":
    main()
