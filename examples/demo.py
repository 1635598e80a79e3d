"""The shardwise demo: a byte-level GPT trained under ZeRO-3 on local text.

    make demo
    # which runs:
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/demo.py

Every process holds half of the parameters, gradients and Adam states (printed at the end);
the loss goes down as the model learns the bytes of this repository's own text files.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT  # GPT-2 shaped, plain torch (the benchmarks train the same class)

import shardwise

ROOT = Path(__file__).resolve().parents[1]


class ByteWindows(Dataset):
    """Every window of `block + 1` bytes, stepping by `block // 2`."""

    def __init__(self, text: bytes, block: int) -> None:
        self.data = torch.tensor(list(text), dtype=torch.long)
        self.block = block
        self.starts = range(0, len(self.data) - block - 1, block // 2)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.starts[i]
        return self.data[s : s + self.block + 1]


def byte_gpt(block: int) -> GPT:
    """The demo's model: a small GPT over the 256 byte values."""
    return GPT(vocab=256, d=192, layers=4, heads=4, block=block)


def local_text(paths: list[str]) -> bytes:
    # the embedded default: this repository's own prose and code
    files = [Path(p) for p in paths] if paths else [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                                      *sorted((ROOT / "src").rglob("*.py"))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"demo: no such text file: {', '.join(missing)}")
    return b"\n".join(f.read_bytes() for f in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", nargs="*", default=[], help="text files to learn (default: this repo)")
    ap.add_argument("--strategy", default="zero3", help="ddp, zero1, zero2 or zero3")
    ap.add_argument("--offload", default="none", help="none, optimizer or params")
    ap.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=8, help="per-process batch")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--run-dir", default="runs/demo", help="where the metrics and their report go")
    args = ap.parse_args()

    engine = shardwise.Engine(
        strategy=args.strategy, offload=args.offload, precision=args.precision, seed=0,
        # metrics.jsonl for `shardwise report`
        log_with="jsonl", project_dir=args.run_dir, log_every_steps=10,
    )
    engine.init_trackers("demo", config=vars(args))
    model = byte_gpt(args.block_size)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # 10 warm-up steps, then a cosine to zero
        optimizer,
        lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)),
    )
    loader = DataLoader(
        ByteWindows(local_text(args.text), args.block_size), batch_size=args.batch_size, shuffle=True
    )
    model, optimizer, scheduler, loader = engine.prepare(model, optimizer, scheduler, loader)
    n_params = sum(p.numel() for p in byte_gpt(args.block_size).parameters())
    engine.print(
        f"shardwise {shardwise.__version__}: {args.strategy} (offload {args.offload}, {args.precision}) on "
        f"{engine.num_processes} process(es), device {engine.device.type}; {n_params / 1e6:.2f}M parameters; "
        f"{len(loader.dataset)} windows of {args.block_size} bytes"
    )

    step, tokens, t0, window = 0, 0, time.perf_counter(), []
    while step < args.steps:
        for batch in loader:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step == args.steps:  # gradients are still held: the footprint at its fullest
                report = engine.memory_report()
            optimizer.zero_grad()
            tokens += batch[:, 1:].numel() * engine.num_processes
            window.append(engine.reduce(loss.detach(), "mean").item())
            if step % 10 == 0 or step == args.steps:
                rate = tokens / (time.perf_counter() - t0)
                engine.print(f"step {step:4d}  loss {sum(window) / len(window):.3f}  {rate:,.0f} tokens/s")
                window = []
            if step == args.steps:
                break
    full = n_params * 4 / 2**20
    engine.print(f"unsharded, one process would hold {full:.2f} MiB each of params and grads, "
                 f"{2 * full:.2f} MiB of Adam state")
    for rank in range(engine.num_processes):  # each rank reports its own share, in order
        if rank == engine.process_index:
            print(f"rank {rank} holds: {report}", flush=True)
        engine.wait_for_everyone()
    engine.print(f"done: {step} steps in {time.perf_counter() - t0:.1f} s")
    engine.end_training()  # writes the last metrics record
    if engine.is_main_process:  # loss, tokens/s and memory per process over the run, as a PNG
        from shardwise.runtime.report import report as make_report

        png, text = make_report(Path(args.run_dir) / "logs" / "demo")
        print(text)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
