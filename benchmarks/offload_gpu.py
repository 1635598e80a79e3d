"""ZeRO-3 + CPU offload tokens/s: shardwise against DeepSpeed used directly, same model and batch.

    torchrun --standalone --nproc-per-node 1 benchmarks/offload_gpu.py   # a GPU: GPT-2 XL, bf16
    python benchmarks/offload_gpu.py --dry-run                          # anywhere: tiny GPT, fp32, CPU

Both peers train the same GPT-2-shaped model (examples/gpt.GPT at GPT-2 XL's sizes: 48 layers,
d 1600, 25 heads, vocab 50304; seed 0) on the same batches, parameters and optimizer state on the
host between uses:
  shardwise   Engine(strategy="zero3", offload="params", precision=...) with torch.optim.AdamW
              (the host step runs torch's fused CPU AdamW over the rank's CPUs)
  deepspeed   deepspeed.initialize with ZeRO stage 3, offload_param and offload_optimizer to cpu
              (pinned), the same precision, DeepSpeedCPUAdam (what DeepSpeed's offload users run;
              --ds-optimizer torch takes torch's AdamW instead, which needs no compiled op)
The peers run in alternating rounds in one process; each round times --steps steps after one
warm-up step; the figure is the median step time over all rounds, tokens/s = batch x sequence /
step. Writes benchmarks/results/offload_gpu-<hardware>-<date>.json. Goal on a GPU: shardwise at
least 1.2x DeepSpeed's tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, RESULTS, lm_loss, write_report

SIZES = {"gpt2-xl": {"vocab": 50304, "d": 1600, "layers": 48, "heads": 25},
         "gpt2-large": {"vocab": 50304, "d": 1280, "layers": 36, "heads": 20},
         "tiny": {"vocab": 512, "d": 64, "layers": 2, "heads": 2}}


def _model(size: str, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(block=seq, **SIZES[size])


def shardwise_peer(size: str, seq: int, precision: str, cpu: bool) -> Callable[[torch.Tensor], float]:
    import shardwise

    engine = shardwise.Engine(preempt_signals=(),
        strategy="zero3", offload="params", precision=precision, cpu=cpu, seed=0, progress=False
    )
    model = _model(size, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)

    def step(ids: torch.Tensor) -> float:
        loss = lm_loss(model, ids.to(engine.device))
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


def deepspeed_peer(size: str, seq: int, precision: str, optimizer: str) -> Callable[[torch.Tensor], float]:
    import deepspeed

    model = _model(size, seq)
    if optimizer == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt: torch.optim.Optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "stage3_param_persistence_threshold": 0},
        "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def step(ids: torch.Tensor) -> float:
        loss = lm_loss(ds, ids.to(ds.device))
        ds.backward(loss)
        ds.step()
        return float(loss)

    return step


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, choices=sorted(SIZES), help="default: gpt2-xl (GPU), tiny (--dry-run)"
    )
    ap.add_argument(
        "--batch", type=int, default=None, help="per-GPU batch (default 8 on a GPU, 2 in --dry-run)"
    )
    ap.add_argument("--seq", type=int, default=None, help="sequence (default 512 on a GPU, 32 in --dry-run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and peer")
    ap.add_argument("--ds-optimizer", default=None, choices=["cpu_adam", "torch"],
                    help="DeepSpeed's optimizer (default cpu_adam on a GPU, torch in --dry-run)")
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, the tiny model, fp32: checks the script anywhere"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    size = args.model or ("tiny" if dry else "gpt2-xl")
    batch = args.batch or (2 if dry else 8)
    seq = args.seq or (32 if dry else 512)
    precision = "fp32" if dry else "bf16"
    ds_opt = args.ds_optimizer or ("torch" if dry else "cpu_adam")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}.items():
        os.environ.setdefault(k, v)  # one process, as torchrun describes it
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, SIZES[size]["vocab"], (batch, seq + 1), generator=g) for _ in range(args.steps + 1)
    ]
    peers: dict[str, Callable[[torch.Tensor], float]] = {
        "shardwise": shardwise_peer(size, seq, precision, dry)
    }
    try:
        peers["deepspeed"] = deepspeed_peer(size, seq, precision, ds_opt)
    except ImportError:
        print("deepspeed is not installed: shardwise alone")
    times: dict[str, list[float]] = {name: [] for name in peers}
    losses: dict[str, list[float]] = {name: [] for name in peers}
    for r in range(args.rounds):
        for name in list(peers) if r % 2 == 0 else list(peers)[::-1]:
            step = peers[name]
            losses[name].append(step(batches[0]))  # warm-up
            for ids in batches[1:]:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                losses[name].append(step(ids))
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
            gc.collect()
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_step_s": med, "spread_s": [min(ts), max(ts)], "tokens_per_s": batch * seq / med,
                      "first_loss": losses[name][0]}
    if "deepspeed" in rows:
        rows["shardwise"]["vs_deepspeed"] = (
            rows["shardwise"]["tokens_per_s"] / rows["deepspeed"]["tokens_per_s"]
        )
    for name, row in rows.items():
        print(f"{name:10s} {row['median_step_s'] * 1e3:9.1f} ms/step  {row['tokens_per_s']:9.1f} tokens/s"
              + (f"  {row['vs_deepspeed']:.2f}x DeepSpeed" if "vs_deepspeed" in row else ""))
    payload = {
        "model": size, "batch": batch, "seq": seq, "precision": precision, "deepspeed_optimizer": ds_opt,
        "rounds": args.rounds, "steps": args.steps, "dry_run": dry, "rows": rows,
    }
    return write_report("offload_gpu", payload, args.out)


if __name__ == "__main__":
    main()
