"""Sequence-to-sequence fine-tuning of a BlenderBot-style chatbot (`transformers` Blenderbot).

    shardwise launch --config examples/configs/zero3.yaml examples/seq2seq.py                  # tiny, CPU
    shardwise launch --config examples/configs/zero3.yaml examples/seq2seq.py \\
        --model blenderbot-400m --block-size 128 --batch-size 8 --steps 2000                    # a GPU box

Dialogue pairs are made in code: the "reply" to a message is the message's tokens in reverse
order, a task a small encoder-decoder learns quickly. Reports training loss and, at the end,
held-out loss and exact-match of greedy replies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, make_optimizer, train

import shardwise

PRESETS = {  # d_model, encoder/decoder layers, heads, ffn, vocab
    "tiny": (64, 2, 2, 128, 64),
    "blenderbot-400m": (1280, 2, 32, 5120, 8008),  # encoder 2 / decoder 12 in the real model
}
PAD, BOS, EOS = 0, 1, 2


def build_model(name: str, block: int) -> torch.nn.Module:
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration

    d, layers, heads, ffn, vocab = PRESETS[name]
    cfg = BlenderbotConfig(
        vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=12 if name != "tiny" else layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_position_embeddings=max(128, block), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
    )
    return BlenderbotForConditionalGeneration(cfg)


def make_dialogues(n: int, length: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    msg = torch.randint(3, 20, (n, length), generator=g)
    reply = torch.cat([msg.flip(1), torch.full((n, 1), EOS)], dim=1)
    return TensorDataset(msg, reply)


def s2s_loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    msg, reply = batch
    return model(input_ids=msg, labels=reply).loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    add_common_args(ap, steps=40, batch=8, block=8)
    ap.set_defaults(lr=3e-3)
    args, _ = ap.parse_known_args()

    engine = shardwise.Engine(seed=args.seed)
    model = build_model(args.model, args.block_size)
    optimizer, scheduler = make_optimizer(model, args.lr, args.warmup, args.steps, decay=False)
    train_loader = DataLoader(
        make_dialogues(512, args.block_size, 0), batch_size=args.batch_size, shuffle=True
    )
    eval_loader = DataLoader(make_dialogues(61, args.block_size, 1), batch_size=args.batch_size)
    model, optimizer, scheduler, train_loader, eval_loader = engine.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )
    train(engine, model, optimizer, scheduler, train_loader, args, s2s_loss,
          lambda b: b[0].numel() + b[1].numel())

    model.eval()
    losses, exact = [], []
    with torch.no_grad():
        for msg, reply in eval_loader:
            loss = s2s_loss(model, [msg, reply]).detach()
            # greedy decoding through the prepared (sharded) model: the same forward, step by step
            out = torch.full((len(msg), 1), BOS, device=msg.device)
            for _ in range(reply.shape[1]):
                logits = model(input_ids=msg, decoder_input_ids=out).logits
                out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            hit = (out[:, 1:] == reply).all(dim=1).float()
            lo, ex = engine.gather_for_metrics((loss[None].repeat(len(msg)), hit))
            losses.append(lo)
            exact.append(ex)
    engine.print(f"eval loss {torch.cat(losses).mean():.4f}  "
                 f"exact-match replies {torch.cat(exact).mean():.3f}  ({len(torch.cat(exact))} dialogues)")
    engine.end_training()


if __name__ == "__main__":
    main()
