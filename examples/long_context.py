"""Long sequences with context parallelism: a transformers Llama trained on rows of packed
documents, each row split along its length over the processes of a context group.

    shardwise launch --config examples/configs/long_context.yaml --cpu examples/long_context.py
    shardwise launch --config examples/configs/long_context.yaml examples/long_context.py \\
        --block-size 32768 --hidden 2048 --layers 16 --steps 1000          # a GPU node

The files of this repository (or --text files) are read as bytes, each a document; documents are
packed into rows of --block-size tokens, their position ids restarting at each document's start
(transformers then masks attention across documents; the model's use_cache is off for it), and
each document's first token is no target of the previous one's last. The loop is an ordinary one
(`model(**batch).loss`): the prepared model splits every row over the context group, and the loss
each process returns is the whole row's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, add_common_args, make_optimizer, train

import shardwise


def build_model(hidden: int, layers: int, block: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(2, hidden // 64)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 16 * 16,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), max_position_embeddings=block,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg)


class PackedRows(Dataset):
    """Documents (byte strings) packed into rows of `block` tokens: input_ids, position_ids
    restarting per document, labels with each document's first token left out (-100)."""

    def __init__(self, documents: list[bytes], block: int) -> None:
        ids, pos, starts = [], [], []
        for doc in documents:
            ids += list(doc)
            pos += range(len(doc))
            starts += [1] + [0] * (len(doc) - 1)
        rows = len(ids) // block
        self.ids = torch.tensor(ids[: rows * block]).view(rows, block)
        self.pos = torch.tensor(pos[: rows * block]).view(rows, block)
        first = torch.tensor(starts[: rows * block], dtype=torch.bool).view(rows, block)
        self.labels = torch.where(first, -100, self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "position_ids": self.pos[i], "labels": self.labels[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", nargs="*", default=[], help="local text files (default: this repository)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    add_common_args(ap, steps=20, batch=1, block=1024)
    args, _ = ap.parse_known_args()

    engine = shardwise.Engine(seed=args.seed)
    files = [Path(p) for p in args.text] or sorted((ROOT / "docs").glob("*.md"))
    rows = PackedRows([f.read_bytes() for f in files], args.block_size)
    model = build_model(args.hidden, args.layers, args.block_size)
    optimizer, scheduler = make_optimizer(model, args.lr, args.warmup, args.steps)
    loader = DataLoader(rows, batch_size=args.batch_size, shuffle=True)
    model, optimizer, scheduler, loader = engine.prepare(model, optimizer, scheduler, loader)
    dims = engine.parallel_dims
    engine.print(f"long context: rows of {args.block_size} tokens, context parallelism "
                 f"{engine.config.parallelism.cp_method} over {dims.cp} process(es) "
                 f"({args.block_size // dims.cp} "
                 f"tokens each), {dims.dp_size} data-parallel rank(s), {engine.config.sharding.strategy}")
    train(engine, model, optimizer, scheduler, loader, args, lambda m, b: m(**b).loss,
          lambda b: b["input_ids"].numel())
    engine.end_training()


if __name__ == "__main__":
    main()
