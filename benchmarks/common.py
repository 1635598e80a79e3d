"""Shared pieces of the benchmark scripts: a GPT-2-shaped model, synthetic tokens, reports."""

from __future__ import annotations

import datetime as _dt
import json
import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

RESULTS = Path(__file__).resolve().parent / "results"


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 4, block: int = 128) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    import os

    return f"cpu{os.cpu_count()}"


def write_report(name: str, payload: dict[str, Any], out: Path = RESULTS) -> Path:
    """JSON named by benchmark, hardware and date."""
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    payload = {
        "benchmark": name,
        "date": date,
        "hardware": hardware(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **payload,
    }
    path = out / f"{name}-{hardware()}-{date}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def finish_distributed(name: str, payload: dict[str, Any], out: Path | None) -> None:
    """Rank 0 writes the report (with the torchrun command that reproduces it); all ranks leave."""
    import sys

    import torch.distributed as dist

    if dist.get_rank() == 0:
        command = (f"python -m torch.distributed.run --standalone --nproc-per-node {dist.get_world_size()} "
                   f"benchmarks/{name}.py " + " ".join(sys.argv[1:])).strip()
        path = write_report(name, {"command": command, "world_size": dist.get_world_size(), **payload},
                            out if out is not None else RESULTS)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
