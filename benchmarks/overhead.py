"""shardwise against a hand-written loop on the same model, strategy and data, in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/overhead.py

For each strategy the raw loop is what an expert would write by hand: DDP for ddp, FSDP2
`fully_shard` per block + root for zero2/zero3, the same AdamW (torch's fused kernel in both), same
clipping. The two loops run in
alternating rounds (so drift in machine load hits both) and the ratio of median step times is
printed and written to benchmarks/results/overhead-<hardware>-<date>.json. Goal: <= 1.02.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, finish_distributed, lm_loss

import shardwise
from shardwise.config import strategy_spec


def raw_model(strategy: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT().to(device)
    spec = strategy_spec(strategy)
    if not spec.shards_optimizer:  # ddp
        model = DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=spec.shards_params)
        fully_shard(model, reshard_after_forward=spec.shards_params)
    # as an expert writes it on a CPU: torch's fused AdamW kernel (the engine steps with it too)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def shardwise_model(
    strategy: str, metrics: bool
) -> tuple[shardwise.Engine, torch.nn.Module, torch.optim.Optimizer]:
    # metrics on (the default): the engine keeps its loss/throughput/memory records and writes
    # them to a JSONL tracker every 10 steps, as a user's run would
    extra = {
        "log_with": "jsonl", "project_dir": tempfile.mkdtemp(prefix="shardwise-bench-"), "log_every_steps": 10
    } if metrics else {}
    engine = shardwise.Engine(preempt_signals=(), strategy=strategy, seed=0, progress=False, **extra)
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)
    return engine, model, opt


def timed_steps(step_fn, batches: list[torch.Tensor]) -> list[float]:
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        step_fn(ids)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=["zero3", "zero2", "ddp"])
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds per strategy")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and loop")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--no-metrics", action="store_true", help="switch off the engine's metrics records")
    args = ap.parse_args()

    results = {}
    for strategy in args.strategies:
        engine, sw_model, sw_opt = shardwise_model(strategy, not args.no_metrics)
        raw, raw_opt = raw_model(strategy, engine.device)
        g = torch.Generator().manual_seed(engine.process_index)
        batches = [
            torch.randint(0, 4096, (args.batch_size, 129), generator=g).to(engine.device)
            for _ in range(args.steps)
        ]

        def raw_step(ids: torch.Tensor) -> None:
            lm_loss(raw, ids).backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            raw_opt.step()
            raw_opt.zero_grad()

        def sw_step(ids: torch.Tensor) -> None:
            engine.backward(lm_loss(sw_model, ids))
            engine.clip_grad_norm_(sw_model.parameters(), 1.0)
            sw_opt.step()
            sw_opt.zero_grad()

        timed_steps(raw_step, batches[:2])  # warm up both
        timed_steps(sw_step, batches[:2])
        raw_t, sw_t = [], []
        for r in range(args.rounds):  # alternate which goes first
            order = [(raw_step, raw_t), (sw_step, sw_t)]
            for fn, acc in order if r % 2 == 0 else order[::-1]:
                acc += timed_steps(fn, batches)
        raw_med, sw_med = statistics.median(raw_t), statistics.median(sw_t)
        results[strategy] = {
            "raw_median_s": raw_med,
            "shardwise_median_s": sw_med,
            "ratio": sw_med / raw_med,
            "steps_each": len(raw_t),
        }
        engine.print(
            f"{strategy:6s} raw {raw_med * 1e3:8.1f} ms/step  shardwise {sw_med * 1e3:8.1f} ms/step  "
            f"ratio {sw_med / raw_med:.3f}"
        )
    finish_distributed("overhead", {
        "model": "GPT d256 L4 vocab4096 seq128 (tied embeddings)",
        "batch_per_rank": args.batch_size,
        "results": results,
    }, args.out)


if __name__ == "__main__":
    main()
