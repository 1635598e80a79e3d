"""Causal language modelling with a `transformers` GPT-2, byte-level, on local text.

    shardwise launch --config examples/configs/zero3.yaml examples/causal_lm.py            # tiny, CPU
    shardwise launch --config examples/configs/zero3_offload_params.yaml examples/causal_lm.py \\
        --model gpt2-xl --block-size 128 --batch-size 8 --steps 1000 --text corpus.txt      # a GPU box

The model is built from its config (no download); text is read as bytes, so any local file
works without a tokenizer. Reports training loss, throughput, and held-out loss/perplexity.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, add_common_args, make_optimizer, train

import shardwise

PRESETS = {  # n_embd, n_layer, n_head
    "tiny": (64, 2, 2),
    "gpt2": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
}


def build_model(name: str, block: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    d, layers, heads = PRESETS[name]
    vocab = 256 if name == "tiny" else 50257  # bytes fit any vocabulary
    cfg = GPT2Config(vocab_size=vocab, n_positions=max(block, 1024 if name != "tiny" else block),
                     n_embd=d, n_layer=layers, n_head=heads)
    return GPT2LMHeadModel(cfg)


class Windows(Dataset):
    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block
        self.starts = range(0, max(1, len(data) - block - 1), block)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[self.starts[i] : self.starts[i] + self.block]


def read_text(paths: list[str]) -> torch.Tensor:
    files = [Path(p) for p in paths] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                     *sorted((ROOT / "src").rglob("*.py"))]
    for f in files:
        if not f.is_file():
            raise SystemExit(f"causal_lm: no such text file: {f}")
    return torch.tensor(list(b"\n".join(f.read_bytes() for f in files)), dtype=torch.long)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--text", nargs="*", default=[], help="local text files (default: this repository)")
    add_common_args(ap, steps=40, batch=4, block=64)
    args, _ = ap.parse_known_args()

    engine = shardwise.Engine(seed=args.seed)
    data = read_text(args.text)
    split = int(len(data) * 0.95)
    train_set, eval_set = Windows(data[:split], args.block_size), Windows(data[split:], args.block_size)
    model = build_model(args.model, args.block_size)
    optimizer, scheduler = make_optimizer(model, args.lr, args.warmup, args.steps)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(eval_set, batch_size=args.batch_size)
    model, optimizer, scheduler, train_loader, eval_loader = engine.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )
    n_params = sum(p.numel() for p in build_model(args.model, args.block_size).parameters())
    engine.print(f"{args.model}: {n_params / 1e6:.1f}M parameters, {engine.config.sharding.strategy} on "
                 f"{engine.num_processes} process(es)")
    train(engine, model, optimizer, scheduler, train_loader, args, lm_loss, lambda b: b.numel())

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in eval_loader:
            losses = engine.gather_for_metrics(lm_loss(model, ids).detach()[None].repeat(len(ids)))
            total += losses.sum().item()
            count += len(losses)
    eval_loss = total / max(1, count)
    engine.print(f"eval loss {eval_loss:.4f}  perplexity {math.exp(eval_loss):.2f}  ({count} windows)")
    engine.end_training()


if __name__ == "__main__":
    main()
