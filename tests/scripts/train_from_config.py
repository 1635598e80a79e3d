"""A training script that takes everything from its launcher: `Engine()` with no keywords.

Rank 0 writes its losses, clip norms, final weights, the resolved config and the LRs to --out.
With --config-optimizer it passes no optimizer to prepare: the config (a DeepSpeed JSON) builds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import workloads as W

import shardwise


def config_optimizer_loop(engine: shardwise.Engine, name: str, batch: int,
                          steps: int) -> tuple[W.Trained, list[float], str]:
    """The loop on the optimizer and scheduler the config built: the run (no clip), the LR after
    each optimizer step, the optimizer's class name."""
    model = W.build(name)
    loader = torch.utils.data.DataLoader(
        W.Tokens(engine.num_processes * batch * engine.config.training.grad_accum_steps * steps),
        batch_size=batch,
        shuffle=True,
    )
    model, loader = engine.prepare(model, loader)
    opt, sched = engine.optimizer, engine.scheduler
    losses, lrs = [], []
    for ids in loader:
        with engine.accumulate(model):
            loss = W.lm_loss(model, ids)
            engine.backward(loss)
            losses.append(engine.reduce(loss.detach(), "mean").item())
            opt.step()
            sched.step()
            opt.zero_grad()
            if engine.sync_gradients:
                lrs.append(sched.get_last_lr()[0])
    return W.Trained(losses, state=engine.get_state_dict(model)), lrs, type(opt.optimizer).__name__


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)  # "--config" must not match --config-optimizer
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--config-optimizer", action="store_true")
    args, _unknown = ap.parse_known_args()  # a plain-torchrun run also carries --config FILE
    engine = shardwise.Engine()
    if args.config_optimizer:
        run, lrs, optimizer = config_optimizer_loop(engine, args.model, args.batch, args.steps)
    else:
        run, lrs, optimizer = W.run_loop(engine, args.model, batch=args.batch, steps=args.steps), [], None
    result = W.Launched(run.losses, run.state, shardwise.config.files.to_dict(engine.config),
                        engine.num_processes, norms=run.norms, lrs=lrs, optimizer=optimizer)
    if engine.is_main_process:
        torch.save(result, args.out)
    engine.end_training()


if __name__ == "__main__":
    main()
