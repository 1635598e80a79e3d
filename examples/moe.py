"""A mixture-of-experts model with expert parallelism: a transformers Mixtral whose experts are
split over the processes, each token sent to the ranks that own its chosen experts and back.

    shardwise launch --config examples/configs/moe.yaml --cpu examples/moe.py
    shardwise launch --config examples/configs/moe.yaml examples/moe.py \\
        --hidden 1024 --experts 8 --layers 8 --steps 1000                  # a GPU node

The files of this repository (or --text files) are read as bytes and cut into rows of
--block-size tokens. The loop is an ordinary one (`model(**batch).loss`); the metrics records
(and `shardwise report`) show the tokens each expert got per step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, add_common_args, make_optimizer, train

import shardwise


def build_model(hidden: int, layers: int, experts: int, block: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    heads = max(2, hidden // 64)
    cfg = MixtralConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 2,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 2),
                        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=block,
                        tie_word_embeddings=False, use_cache=False)
    return MixtralForCausalLM(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", nargs="*", default=[], help="local text files (default: this repository)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    add_common_args(ap, steps=20, batch=2, block=128)
    args, _ = ap.parse_known_args()

    engine = shardwise.Engine(seed=args.seed)
    files = [Path(p) for p in args.text] or sorted((ROOT / "docs").glob("*.md"))
    data = b"".join(f.read_bytes() for f in files)
    block = args.block_size
    rows = torch.tensor(list(data[: len(data) // block * block])).view(-1, block)
    samples = [{"input_ids": r, "labels": r} for r in rows]
    model = build_model(args.hidden, args.layers, args.experts, args.block_size)
    optimizer, scheduler = make_optimizer(model, args.lr, args.warmup, args.steps)
    loader = DataLoader(samples, batch_size=args.batch_size, shuffle=True)
    model, optimizer, scheduler, loader = engine.prepare(model, optimizer, scheduler, loader)
    dims = engine.parallel_dims
    engine.print(f"mixture of experts: {args.experts} experts per layer split over {dims.ep} process(es) "
                 f"({args.experts // dims.ep} each), {dims.dp_size} data-parallel rank(s), "
                 f"{engine.config.sharding.strategy}")
    train(engine, model, optimizer, scheduler, loader, args, lambda m, b: m(**b).loss,
          lambda b: b["input_ids"].numel())
    engine.end_training()


if __name__ == "__main__":
    main()
