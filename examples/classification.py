"""Text-pair classification with a `transformers` DeBERTa-v2, reporting accuracy and F1.

    shardwise launch --config examples/configs/zero2.yaml examples/classification.py          # tiny, CPU
    shardwise launch --config examples/configs/zero3.yaml examples/classification.py \\
        --model deberta-v2-xlarge --block-size 128 --batch-size 8 --steps 2000                 # a GPU box

The data is made in code (the hub is not needed): each example is "[CLS] a [SEP] b [SEP]"
over two "topics" (token ranges). Label 1 (paraphrase): b is a noisy copy of a, both on topic
0. Label 0: a is on topic 1 and b on topic 0. 15% of the labels are flipped (annotation
noise). Synthetic and easy on purpose, so a tiny model learns it in a short CPU run. Metrics are
computed on every process's predictions, gathered without the samples repeated to even out the
last batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, make_optimizer, train

import shardwise

PRESETS = {  # hidden, layers, heads, intermediate, vocab
    "tiny": (64, 2, 2, 128, 64),
    "deberta-v2-xlarge": (1536, 24, 24, 6144, 128100),
}
CLS, SEP, PAD = 1, 2, 0


def build_model(name: str, block: int) -> torch.nn.Module:
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    hidden, layers, heads, inter, vocab = PRESETS[name]
    cfg = DebertaV2Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=inter, max_position_embeddings=max(512, block), type_vocab_size=2,
        num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        relative_attention=True, position_buckets=min(256, block), pos_att_type=["p2c", "c2p"],
    )
    return DebertaV2ForSequenceClassification(cfg)


def make_pairs(n: int, block: int, seed: int, topics: int = 2, width: int = 30) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    half = (block - 3) // 2

    def draw(topic: torch.Tensor) -> torch.Tensor:
        return 3 + topic[:, None] * width + torch.randint(0, width, (n, half), generator=g)

    topic = torch.randint(0, topics, (n,), generator=g)
    other = (topic + torch.randint(1, topics, (n,), generator=g)) % topics
    a = draw(topic)
    label = (topic == 0).long()  # topic-0 pairs are the paraphrases
    noisy = torch.where(torch.rand(n, half, generator=g) < 0.15, draw(topic), a)
    b = torch.where(label[:, None].bool(), noisy, draw(other))
    flip = torch.rand(n, generator=g) < 0.15  # annotation noise: no model scores 100%
    label = torch.where(flip, 1 - label, label)
    ids = torch.cat([torch.full((n, 1), CLS), a, torch.full((n, 1), SEP), b, torch.full((n, 1), SEP)], dim=1)
    types = torch.cat(
        [torch.zeros(n, half + 2, dtype=torch.long), torch.ones(n, half + 1, dtype=torch.long)], dim=1
    )
    return TensorDataset(ids, types, label)


def classify_loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    ids, types, labels = batch
    return model(input_ids=ids, token_type_ids=types, labels=labels).loss


def evaluate(engine: shardwise.Engine, model: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for ids, types, y in loader:
            logits = model(input_ids=ids, token_type_ids=types).logits
            p, t = engine.gather_for_metrics((logits.argmax(-1), y))
            preds.append(p)
            labels.append(t)
    pred, gold = torch.cat(preds), torch.cat(labels)
    tp = int(((pred == 1) & (gold == 1)).sum())
    fp = int(((pred == 1) & (gold == 0)).sum())
    fn = int(((pred == 0) & (gold == 1)).sum())
    f1 = 2 * tp / max(1, 2 * tp + fp + fn)
    return {"accuracy": float((pred == gold).float().mean()), "f1": f1, "n": len(gold)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--train-size", type=int, default=512)
    ap.add_argument(
        "--eval-size", type=int, default=203, help="deliberately not a multiple of the global batch"
    )
    ap.add_argument("--metrics-out", default=None, help="write the eval metrics as JSON here")
    add_common_args(ap, steps=60, batch=8, block=32)
    ap.set_defaults(lr=2e-3)  # flat after warm-up (see make_optimizer(decay=False))
    args, _ = ap.parse_known_args()

    engine = shardwise.Engine(seed=args.seed)
    model = build_model(args.model, args.block_size)
    optimizer, scheduler = make_optimizer(model, args.lr, args.warmup, args.steps, decay=False)
    train_loader = DataLoader(
        make_pairs(args.train_size, args.block_size, 0), batch_size=args.batch_size, shuffle=True
    )
    eval_loader = DataLoader(make_pairs(args.eval_size, args.block_size, 1), batch_size=args.batch_size)
    model, optimizer, scheduler, train_loader, eval_loader = engine.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )
    train(engine, model, optimizer, scheduler, train_loader, args, classify_loss, lambda b: b[0].numel())
    metrics = evaluate(engine, model, eval_loader)
    engine.print(f"eval accuracy {metrics['accuracy']:.4f}  F1 {metrics['f1']:.4f}  ({metrics['n']} pairs)")
    if args.metrics_out and engine.is_main_process:
        Path(args.metrics_out).write_text(json.dumps(metrics))
    engine.end_training()


if __name__ == "__main__":
    main()
