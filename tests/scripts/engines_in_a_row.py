"""Several Engines one after another in one process, as a sweep or a train-then-evaluate script
does: each trains the tiny model from scratch under its strategy and ends with end_training(),
which leaves the process group; the next Engine joins a new one. Rank 0 saves every run's
Trained record, in order, to --out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import workloads as W

import shardwise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategies", default="zero3,ddp,zero2,zero3")
    args = ap.parse_args()
    runs = []
    for strategy in args.strategies.split(","):
        engine = shardwise.Engine(strategy=strategy, cpu=True, grad_accum_steps=2, seed=W.SEED)
        runs.append(W.run_loop(engine, "tiny", batch=2, steps=4))
        main_process = engine.is_main_process
        engine.end_training()
    if main_process:
        torch.save(runs, args.out)


if __name__ == "__main__":
    main()
