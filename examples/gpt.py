"""A GPT-2-shaped model in plain torch: the demo's byte-level model and the benchmarks' GPT.

Learned positions, pre-norm blocks, a tied input/output embedding and GPT-2's initialisation.
It needs only torch, so the examples run from a fresh clone with shardwise installed; the
benchmarks import it from here (benchmarks/common.py) rather than keeping a copy.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, time, d) -> (batch, time, d)."""
        b, t, _ = x.shape
        # (b, t, 3 * heads * head_dim) -> three (b, heads, t, head_dim); under tensor parallelism
        # qkv holds this rank's heads only (and `heads` counts them), so no width is assumed
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 shaped over `vocab` token ids (256 for bytes), `block` positions long."""

    # How shardwise splits it under `tensor_parallel_size` (read from the model): the fused
    # query/key/value projection per third by heads, the MLP's first layer by columns, the
    # projections back by rows; embeddings, norms and the tied head stay whole.
    tensor_parallel_plan: ClassVar[dict[str, str]] = {
        "blocks.*.qkv": "colwise_qkv", "blocks.*.proj": "rowwise",
        "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def __init__(
        self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 4, block: int = 128
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied input/output embedding
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids -> (batch, time, vocab) logits."""
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))
