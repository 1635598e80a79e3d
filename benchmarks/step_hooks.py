"""What the engine adds to each optimizer step, hook by hook, on the overhead benchmark's model.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step_hooks.py

Each hook the engine runs besides the user's work is timed with `time.perf_counter` around it
(the heartbeats of the forward and the backward, and each hook of the step boundary:
observation, supervision, the compile watch), over `--steps` steps
of the loop `benchmarks/overhead.py` times, metrics on (a JSONL record every 10 steps). Prints
milliseconds per step for each, and writes benchmarks/results/step_hooks-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, finish_distributed, lm_loss

import shardwise


def _timed(table: dict[str, list[float]], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key].append(time.perf_counter() - t0)
    return run


def measure(strategy: str, steps: int, accumulate: bool) -> dict[str, float]:
    engine = shardwise.Engine(preempt_signals=(), strategy=strategy, seed=0, progress=False, log_with="jsonl",
                              project_dir=tempfile.mkdtemp(prefix="shardwise-hooks-"), log_every_steps=10)
    table: dict[str, list[float]] = defaultdict(list)
    # the probe wraps the engine's own objects' methods on this instance (a benchmark, not the product)
    hooks = engine._boundary_hooks  # the step boundary's ordered hooks, each timed
    hooks.hooks = [(name, _timed(table, f"boundary: {name}", hook)) for name, hook in hooks.hooks]
    engine._supervisor.heartbeat = _timed(table, "heartbeats", engine._supervisor.heartbeat)
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)
    g = torch.Generator().manual_seed(engine.process_index)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, 4096, (4, 129), generator=g)
        t0 = time.perf_counter()
        with engine.accumulate(model) if accumulate else _nothing():
            engine.backward(lm_loss(model, ids))
            engine.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
    row = {key: 1e3 * sum(v) / steps for key, v in sorted(table.items())}
    row["step_ms_median"] = 1e3 * statistics.median(times)
    engine.free_memory()
    return row


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=["zero3", "zero2", "ddp"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = {}
    for strategy in args.strategies:
        for loop in ("plain", "accumulate"):
            row = measure(strategy, args.steps, loop == "accumulate")
            results[f"{strategy} {loop}"] = row
            if torch.distributed.get_rank() == 0:
                hooks = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step_ms_median")
                print(f"{strategy:5s} {loop:10s} step {row['step_ms_median']:.1f} ms; ms per step: {hooks}")
    finish_distributed("step_hooks", {"model": "GPT d256 L4 vocab4096 seq128", "steps": args.steps,
                                      "results": results}, args.out)


if __name__ == "__main__":
    main()
