"""shardwise's two engines side by side: backend="torch" (FSDP2 / DDP + our ZeRO-1) against
backend="deepspeed" (DeepSpeed ZeRO), the same loop and model, each stage, in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/engines.py

For each stage (and offload setting) both engines train the same GPT (same seed, data, AdamW,
clipping) through the same shardwise script; only `backend=` differs. Reported per rank: the
median step time, tokens/s, tensor memory counted the same way for both (compare.py's census:
every live tensor storage after a step, plus what autograd saves for backward), the final loss,
and the ratios deepspeed / torch. Results go to benchmarks/results/engines-<hw>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
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


def engine_peer(backend: str, setup: str) -> Peer:
    """compare.py's shardwise peer on one engine (`setup` is strategy[+offload])."""
    strategy, _, offload = setup.partition("+")
    peer = shardwise_peer(strategy, offload or "none", backend)
    peer.name = backend
    return peer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", nargs="+", default=SETUPS, help="strategy[+offload] per row")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    shardwise.Engine(seed=0)  # joins the process group both engines share
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, MODEL["vocab"], (args.batch_size, MODEL["block"] + 1), generator=g).to(device)
               for _ in range(args.steps)]
    tokens = args.batch_size * MODEL["block"] * world
    rows = []
    for setup in args.setups:
        pair = {b: measure(lambda b=b: engine_peer(b, setup), batches, args.warmup) for b in ("torch", "deepspeed")}
        t, d = pair["torch"], pair["deepspeed"]
        row = {
            "setup": setup,
            "torch_ms": round(t["median_step_s"] * 1e3, 1), "deepspeed_ms": round(d["median_step_s"] * 1e3, 1),
            "time_ratio": round(d["median_step_s"] / t["median_step_s"], 3),
            "torch_tokens_per_s": round(tokens / t["median_step_s"]), "deepspeed_tokens_per_s": round(tokens / d["median_step_s"]),
            "torch_mib": t["tensor_mib"], "deepspeed_mib": d["tensor_mib"],
            "torch_state_mib": t["state_mib"], "deepspeed_state_mib": d["state_mib"],
            "memory_ratio": round(d["tensor_mib"] / t["tensor_mib"], 3),
            "torch_loss": t["final_loss"], "deepspeed_loss": d["final_loss"],
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        _write(rows, args, world)
    dist.barrier()
    dist.destroy_process_group()


def _write(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    import datetime

    stem = f"engines-{hardware()}-{datetime.date.today().isoformat()}"
    path = write_report("engines", {
        "command": f"python -m torch.distributed.run --standalone --nproc-per-node {world} benchmarks/engines.py "
                   + " ".join(sys.argv[1:]),
        "world_size": world, "model": f"GPT {MODEL}", "batch_per_rank": args.batch_size,
        "steps": args.steps, "warmup": args.warmup, "rows": rows,
    }, args.out)
    lines = ["| setup | torch ms/step | deepspeed ms/step | time ratio ds/torch | torch MiB/rank (state) | "
             "deepspeed MiB/rank (state) | memory ratio | final loss torch / ds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['torch_ms']:.0f} | {r['deepspeed_ms']:.0f} | {r['time_ratio']:.2f} | "
                     f"{r['torch_mib']} ({r['torch_state_mib']}) | {r['deepspeed_mib']} ({r['deepspeed_state_mib']}) | "
                     f"{r['memory_ratio']:.2f} | {r['torch_loss']:.4f} / {r['deepspeed_loss']:.4f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path} and {stem}.md")


if __name__ == "__main__":
    main()
