"""Direct Preference Optimization (DPO): a trained policy beside a frozen reference model.

    shardwise launch --config examples/configs/zero3.yaml examples/dpo.py            # tiny, CPU

Policy and reference start as the same GPT-2 (built from its config, no download). The reference
is frozen, so `prepare` readies it for inference only: under zero3 each process holds 1/N of it
and gathers one block at a time for its forward, with no gradients and no optimizer state (a
replica under ddp, zero1 and zero2), on either backend. The preference pairs are made here: a
window of local text (`--text FILE ...`; default: this repository's docs and source) is "chosen",
the same bytes shuffled are "rejected". Prints the DPO loss and
the reward accuracy (the share of pairs whose chosen reply the policy now favours more than the
reference does).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from causal_lm import PRESETS, build_model, read_text
from common import add_common_args, make_optimizer

import shardwise


class Pairs(Dataset):
    """(chosen, rejected): a window of text, and its bytes in a fixed random order."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block
        self.starts = range(0, max(1, len(data) - block), block)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chosen = self.data[self.starts[i] : self.starts[i] + self.block]
        order = torch.randperm(len(chosen), generator=torch.Generator().manual_seed(i))
        return {"chosen": chosen, "rejected": chosen[order]}


def sequence_logps(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed next-token log-probability, (B,)."""
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy: torch.nn.Module, ref: torch.nn.Module, batch: dict[str, torch.Tensor],
             beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The DPO loss of a batch and each pair's reward margin. Chosen and rejected go through each
    model in one forward (one all-gather of each block under zero3, not two)."""
    ids = torch.cat([batch["chosen"], batch["rejected"]])
    n = len(batch["chosen"])
    with torch.no_grad():  # the reference only scores: no graph, no gradients
        ref_logps = sequence_logps(ref, ids)
    logps = sequence_logps(policy, ids)
    margin = beta * ((logps[:n] - ref_logps[:n]) - (logps[n:] - ref_logps[n:]))
    return -F.logsigmoid(margin).mean(), margin.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--beta", type=float, default=0.1, help="DPO temperature")
    ap.add_argument("--text", nargs="*", default=[], help="local text files (default: this repository)")
    add_common_args(ap, steps=20, batch=4, block=32)
    args, _ = ap.parse_known_args()

    engine = shardwise.Engine(seed=args.seed)
    policy = build_model(args.model, args.block_size)
    ref = copy.deepcopy(policy).requires_grad_(False).eval()  # the starting point, frozen
    optimizer, scheduler = make_optimizer(policy, args.lr, args.warmup, args.steps, decay=False)
    pairs = Pairs(read_text(args.text), args.block_size)
    loader = DataLoader(pairs, batch_size=args.batch_size, shuffle=True)
    ref = engine.prepare(ref)  # alone: prepared for inference only
    policy, optimizer, scheduler, loader = engine.prepare(policy, optimizer, scheduler, loader)
    engine.print(f"{args.model}: policy + frozen reference, {engine.config.sharding.strategy} on "
                 f"{engine.num_processes} process(es)")
    while engine.step < args.steps:
        for batch in loader:
            with engine.accumulate(policy):
                loss, margin = dpo_loss(policy, ref, batch, args.beta)
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not engine.sync_gradients:
                continue
            won = engine.gather(margin > 0).float().mean().item()
            loss_mean = engine.reduce(loss.detach(), "mean").item()
            if engine.step % args.log_every == 0 or engine.step == args.steps:
                engine.print(f"step {engine.step:5d}  dpo loss {loss_mean:.4f}  reward accuracy {won:.2f}")
            if engine.step >= args.steps:
                break
    if args.output_dir:
        engine.save_model(policy, args.output_dir)
        engine.print(f"saved the policy to {args.output_dir}")
    engine.end_training()


if __name__ == "__main__":
    main()
