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
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import shardwise

ROOT = Path(__file__).resolve().parents[1]


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """GPT-2 shaped (learned positions, pre-norm blocks, tied embedding), over 256 byte values."""

    def __init__(self, d: int = 192, layers: int = 4, heads: int = 4, block: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(256, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.head.weight = self.wte.weight  # tied input/output embedding
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


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
        log_with="jsonl", project_dir=args.run_dir, log_every_steps=10,  # metrics.jsonl for `shardwise report`
    )
    engine.init_trackers("demo", config=vars(args))
    model = ByteGPT(block=args.block_size)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    loader = DataLoader(ByteWindows(local_text(args.text), args.block_size), batch_size=args.batch_size, shuffle=True)
    model, optimizer, scheduler, loader = engine.prepare(model, optimizer, scheduler, loader)
    n_params = sum(p.numel() for p in ByteGPT(block=args.block_size).parameters())
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
    engine.print(f"unsharded, one process would hold {full:.2f} MiB each of params and grads, {2 * full:.2f} MiB of Adam state")
    for rank in range(engine.num_processes):  # each rank reports its own share, in order
        if rank == engine.process_index:
            print(f"rank {rank} holds: {report}", flush=True)
        engine.wait_for_everyone()
    engine.print(f"done: {step} steps in {time.perf_counter() - t0:.1f} s")
    engine.end_training()  # writes the last metrics record
    if engine.is_main_process:  # loss, tokens/s and memory per process over the run, as a PNG
        from shardwise.report import report as make_report

        png, text = make_report(Path(args.run_dir) / "logs" / "demo")
        print(text)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
