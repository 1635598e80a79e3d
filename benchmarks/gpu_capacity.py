"""The largest batch each strategy fits under a memory budget, and its throughput (one GPU).

    python benchmarks/gpu_capacity.py --budget-gb 24   # on a GPU: GPT-2 Large/XL, DeBERTa-v2-xlarge
    python benchmarks/gpu_capacity.py --dry-run        # anywhere: tiny models, a simulated budget

The budget is enforced with torch.cuda.set_per_process_memory_fraction, so an allocation past
it raises OutOfMemoryError exactly as on a 24 GB card. For each model and strategy the batch is
doubled until a training step fails, then bisected; the largest batch that ran is timed over a
few steps. One JSON file is written to benchmarks/results/. In --dry-run mode (CPU, tiny
models) the "budget" is a tensor-byte limit checked after each step, which exercises the same
search and reporting.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_report

import shardwise

MODELS = {  # name -> (family, sizes)
    "gpt2-large": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    "gpt2-xl": ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
    "deberta-v2-xlarge": (
        "deberta",
        {"hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 24, "intermediate_size": 6144},
    ),
}
TINY = {
    "gpt2-tiny": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 2}),
    "deberta-tiny": (
        "deberta",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
    ),
}
STRATEGIES = [("ddp", "none"), ("zero2", "optimizer"), ("zero3", "params")]


class OutOfBudget(RuntimeError):
    """A step needed more memory than the budget."""


def build(family: str, sizes: dict[str, int], seq: int, tiny: bool) -> torch.nn.Module:
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=512 if tiny else 50257, n_positions=seq, **sizes))
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    return DebertaV2ForSequenceClassification(
        DebertaV2Config(vocab_size=512 if tiny else 128100, num_labels=2, **sizes)
    )


def make_step(
    family: str, engine: shardwise.Engine, model: Any, opt: Any, seq: int, vocab: int
) -> Callable[[int], None]:
    def step(batch: int) -> None:
        ids = torch.randint(0, vocab, (batch, seq), device=engine.device)
        if family == "gpt2":
            loss = model(input_ids=ids, labels=ids).loss
        else:
            labels = torch.zeros(batch, dtype=torch.long, device=engine.device)
            loss = model(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def largest_batch(fits: Callable[[int], bool], limit: int) -> int:
    """The largest b in 1..limit with fits(b), assuming fits is monotone: double, then bisect."""
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        trial = good * 2
        if trial > limit:
            return good if not fits(limit) else limit
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def measure_one(name: str, family: str, sizes: dict[str, int], strategy: str, offload: str,
                args: argparse.Namespace) -> dict[str, Any]:
    """Largest batch and its throughput for one model under one strategy. Everything it builds
    is local, so it is freed before the next model is built."""
    tiny = args.dry_run
    engine = shardwise.Engine(preempt_signals=(),
                              strategy=strategy, offload=offload, precision=args.precision,
                              cpu=tiny, activation_checkpointing=args.activation_checkpointing)
    model = build(family, sizes, args.seq_len, tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = engine.prepare(model, opt)
    step = make_step(family, engine, model, opt, args.seq_len, 512 if tiny else 1000)

    def fits(batch: int) -> bool:
        try:
            step(batch)
            if tiny and (
                engine.memory_report().total + batch * args.dry_run_bytes_per_sample > args.budget_bytes
            ):
                raise OutOfBudget
            return True
        except (torch.cuda.OutOfMemoryError, OutOfBudget):
            opt.zero_grad()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return False

    best = largest_batch(fits, args.max_batch)
    rate, searched = None, best
    while best and rate is None:
        # The timed steps run at the largest batch the search found; one that fitted once can
        # fail on a later step (the allocator's free blocks fragmented by the failed trials):
        # then the largest batch is the one below, and the row says both.
        try:
            rate = timed(step, best, args)
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad()
            gc.collect()
            torch.cuda.empty_cache()
            best -= 1
    return {"model": name, "strategy": strategy, "offload": offload, "max_batch": best,
            "search_max_batch": searched, "tokens_per_s": round(rate, 1) if rate else None}


def timed(step: Callable[[int], None], batch: int, args: argparse.Namespace) -> float:
    """Tokens per second over args.timed_steps steps at `batch`, after one untimed step."""
    step(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.timed_steps):
        step(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return batch * args.seq_len * args.timed_steps / (time.perf_counter() - t0)


def run(models: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, (family, sizes) in models.items():
        for strategy, offload in STRATEGIES:
            row = measure_one(name, family, sizes, strategy, offload, args)
            print(row, flush=True)
            rows.append(row)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=24.0)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default=None, help="default: bf16 on a GPU, fp32 in --dry-run")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny models, simulated budget")
    ap.add_argument("--dry-run-bytes-per-sample", type=int, default=200_000)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.precision = args.precision or ("fp32" if args.dry_run else "bf16")
    table = TINY if args.dry_run else MODELS
    models = {m: table[m] for m in (args.models or table)}
    if args.dry_run:
        args.budget_bytes = int(args.budget_gb * 2**20)  # "GB" are MiB in a dry run
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_capacity: no GPU here; use --dry-run")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * 2**30 / total))
    t0 = time.perf_counter()
    rows = run(models, args)
    return write_report("gpu_capacity" + ("-dry-run" if args.dry_run else ""), {
        "command": "python benchmarks/gpu_capacity.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "budget_gb": args.budget_gb, "seq_len": args.seq_len, "precision": args.precision,
        "seconds": round(time.perf_counter() - t0, 1), "rows": rows,
    }, args.out)


if __name__ == "__main__":
    print(f"wrote {main()}")
