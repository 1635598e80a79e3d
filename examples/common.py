"""What the three examples share: flags, the training loop, checkpointing. Public API only."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardwise

ROOT = Path(__file__).resolve().parents[1]


def add_common_args(ap: argparse.ArgumentParser, *, steps: int, batch: int, block: int) -> None:
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=batch, help="per-process batch")
    ap.add_argument("--block-size", type=int, default=block, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5, help="linear warm-up steps")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint (checkpoint_dir in the config)")
    ap.add_argument("--output-dir", default=None, help="save the trained model here (safetensors)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument(
        "--seed", type=int, default=0, help="seeds the model's init and the data order (every process)"
    )


def make_optimizer(
    model: torch.nn.Module, lr: float, warmup: int, steps: int, *, decay: bool = True
) -> tuple[Any, Any]:
    """AdamW without weight decay on biases and norms, linear warm-up then linear decay (or flat)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / max(1, warmup)) * (max(0.0, 1 - s / max(1, steps)) if decay else 1.0),
    )
    return opt, sched


def train(
    engine: shardwise.Engine,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    loader: Any,
    args: argparse.Namespace,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    tokens_in: Callable[[Any], int],
) -> list[float]:
    """The loop every example runs: accumulate, clip, step, log, checkpoint."""
    if args.resume:
        engine.load_state()  # the newest checkpoint under checkpoint_dir, if there is one
    losses: list[float] = []
    window: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    while engine.step < args.steps:
        for batch in loader:
            with engine.accumulate(model):
                loss = loss_fn(model, batch)
                engine.backward(loss)
                if engine.sync_gradients:
                    engine.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            tokens += tokens_in(batch) * engine.parallel_dims.dp_size  # (a tp or cp group: one batch)
            window.append(engine.reduce(loss.detach(), "mean").item())
            if not engine.sync_gradients:
                continue
            losses.append(sum(window) / len(window))
            window = []
            if engine.step % args.log_every == 0 or engine.step == args.steps:
                rate = tokens / (time.perf_counter() - t0)
                engine.print(f"step {engine.step:5d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s")
            if args.save_every and engine.step % args.save_every == 0:
                engine.save_state(keep_last=args.keep_last)
            if engine.step >= args.steps:
                break
    if args.output_dir:
        engine.save_model(model, args.output_dir)
        engine.print(f"saved the model to {args.output_dir}")
    return losses
