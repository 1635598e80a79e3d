"""Attention over a sequence split along its length across the ranks of a context-parallel group
(`strategies.context_parallel` splits the batch and registers these with transformers).

Each rank holds the queries, keys and values of its tokens only. Two ways to attend to the whole
sequence, both exact against one process (the same mask, fp32 round-off aside):

- **Ulysses** (`ulysses_attention`): one all-to-all turns sequence shards into head shards (each
  rank then holds every token of H / N heads), attention runs on whole sequences, a second
  all-to-all turns the output back. Needs the heads to divide by N; key/value heads that do not
  are repeated up to the query heads first (as DeepSpeed's Ulysses does).
- **Ring** (`ring_attention`): the key/value blocks travel around the group (send/recv, which gloo
  runs); each rank merges its queries' attention to every block by the online softmax on the
  log-sum-exp. The backward sends the blocks round again with their key/value gradients, which
  arrive back at their owner. With the zigzag split (rank r holds chunks r and 2N-1-r) every rank
  has the same share of the causal mask's unmasked chunk pairs, and fully masked pairs are
  skipped.

The mask is the one transformers builds for one process: causal in sequence order, key padding
from the attention mask, and, where no attention mask is given and the position ids restart,
documents packed into one row attend only within themselves (`Split.block_mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F


@dataclass(frozen=True)
class Split:
    """One batch's split along the sequence over a context group: which tokens each rank holds
    and what the mask needs to know of every token (the same on every rank of the group)."""

    index: tuple[torch.Tensor, ...]
    """For each rank of the group, the sequence positions of its tokens (ascending)."""
    valid: torch.Tensor
    """[batch, seq] bool: the token may be attended to (attention_mask; all True without one)."""
    doc: torch.Tensor
    """[batch, seq] int: the document of each token (packed sequences; all 0 otherwise)."""
    causal_only: bool = False
    """No padding and one document per row: the mask is the causal one alone."""
    chunk: int = 0
    """The ring's chunk of tokens (sequence / 2N: each rank holds two), the unit whose pairs it
    computes or skips (0: a rank's tokens as one)."""

    def block_mask(self, q: torch.Tensor, k: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """[batch, 1, len(q), len(k)] bool: which of the keys at positions `k` the queries at
        positions `q` attend to (`window`: a layer's sliding window, as transformers masks it: a
        query sees the `window` latest keys, itself included)."""
        causal = k[None, :] <= q[:, None]
        if window is not None:
            causal = causal & (k[None, :] > q[:, None] - window)
        same = self.doc[:, q][:, :, None] == self.doc[:, k][:, None, :]
        return (causal[None] & same & self.valid[:, k][:, None, :]).unsqueeze(1)


def repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H * times, S, D], each head repeated `times` times in place (GQA)."""
    if times == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, times, s, d).reshape(b, h * times, s, d)


# -- differentiable collectives (gloo-safe; torch.distributed.nn.functional is deprecated) -------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single of equal splits along dim 0; the backward is the same exchange back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOver(torch.autograd.Function):
    """all_reduce(SUM) of a value every rank of `group` then holds; the backward sums the
    gradients the same way (each rank's share of the sum was used by every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def sum_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, on each of them (differentiable)."""
    return _SumOver.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


class _GatherSeq(torch.autograd.Function):
    """all_gather along dim 1 (each rank's tokens, concatenated in rank order); the backward, like
    `_SumOver`'s, sums the gradients over the group (every rank used the whole tensor) and keeps
    this rank's tokens."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), x.shape[1]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out.narrow(1, ctx.rank * ctx.size, ctx.size).contiguous(), None


def gather_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `x` along dim 1, concatenated in rank order, on each of them (differentiable:
    the gradient each rank's part gets is the group's sum, as `sum_over`'s)."""
    return _GatherSeq.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


# -- Ulysses ------------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """[B, H, S/N, D] (this rank's tokens, every head) -> [B, H/N, S, D] (every token, this rank's
    heads), by one all-to-all (differentiable: its backward is the reverse all-to-all)."""
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    recv: torch.Tensor = _AllToAll.apply(send, group)  # type: ignore[no-untyped-call]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """The reverse of `_seq_to_heads`: [B, H/N, S, D] -> [B, H, S/N, D]."""
    b, h, s, d = x.shape
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv: torch.Tensor = _AllToAll.apply(send, group)  # type: ignore[no-untyped-call]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * h, s // n, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: Split,
                      group: dist.ProcessGroup, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens ([B, H, S/N, D] each; contiguous chunks in rank order) to
    the whole sequence; returns [B, H, S/N, D]."""
    n = dist.get_world_size(group)
    if k.shape[1] % n:  # key/value heads N does not divide: repeated to the query heads
        k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    q, k, v = (_seq_to_heads(t, group, n) for t in (q, k, v))
    k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    if split.causal_only and window is None:  # (the fused kernel: no mask, no saved attention matrix)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        every = torch.cat(split.index)
        # (a query row with no key to attend to, a left-padded row's first tokens, gets a zero
        # output from torch's kernel, as in one process and the ring: the last pad token's
        # shifted label is the first real token, so that row reaches the loss)
        mask = split.block_mask(every, every, window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _heads_to_seq(out, group, n)


# -- Ring ---------------------------------------------------------------------------------------
def zigzag_index(seq: int, n: int) -> tuple[torch.Tensor, ...]:
    """For each of `n` ranks, its positions of a sequence of `seq` tokens cut into 2n chunks:
    chunk r and chunk 2n-1-r (the causal mask's work is then the same on every rank)."""
    chunk = seq // (2 * n)
    return tuple(torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                            torch.arange((2 * n - 1 - r) * chunk, (2 * n - r) * chunk)]) for r in range(n))


def contiguous_index(seq: int, n: int) -> tuple[torch.Tensor, ...]:
    """For each of `n` ranks, its contiguous 1/n of a sequence of `seq` tokens."""
    part = seq // n
    return tuple(torch.arange(r * part, (r + 1) * part) for r in range(n))


def _chunks(n: int, chunk: int) -> list[slice]:
    """A rank's `n` tokens in chunks of `chunk` (two for a zigzag share; 0: one)."""
    step = chunk or n
    return [slice(a, a + step) for a in range(0, n, step)]


def _pairs(split: Split, qi: torch.Tensor, ki: torch.Tensor,
           window: int | None = None) -> list[tuple[slice, slice, torch.Tensor]]:
    """The (query chunk, key chunk, mask) pairs of one block with any key to attend to: with the
    zigzag split every rank gets as many, and as large, as every other under the causal mask."""
    out = []
    for qs in _chunks(len(qi), split.chunk):
        for ks in _chunks(len(ki), split.chunk):
            if int(qi[qs][-1]) < int(ki[ks][0]):  # the whole key chunk lies in the future
                continue
            mask = split.block_mask(qi[qs], ki[ks], window)
            if bool(mask.any()):
                out.append((qs, ks, mask))
    return out


class _Ring:
    """The send/recv of one ring step: to the next rank of the group, from the previous one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.n)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.n)

    def pass_on(self, flat: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(flat)
        ops = [dist.P2POp(dist.isend, flat, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return recv

    def source(self, step: int) -> int:
        """The group rank whose block this rank holds at ring step `step`."""
        return (self.rank - step) % self.n


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out


MERGE_DTYPE = torch.float32  # the ring's online softmax (its output and log-sum-exp), whatever the inputs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: Split,
                group: dist.ProcessGroup, scale: float, window: int | None) -> torch.Tensor:
        ring = _Ring(group)
        qi = split.index[ring.rank]
        out = torch.zeros_like(q, dtype=MERGE_DTYPE)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=MERGE_DTYPE or q.dtype, device=q.device)
        kb, vb = k, v  # the key/value block held at each step: this rank's first, then the ring's
        for step in range(ring.n):
            for qs, ks, mask in _pairs(split, qi, split.index[ring.source(step)], window):
                s = (q[:, :, qs].float() @ kb[:, :, ks].float().transpose(-1, -2)) * scale
                s = s.masked_fill(~mask, -math.inf)
                block_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - block_lse[..., None]).nan_to_num(0.0)
                o = p @ vb[:, :, ks].float()
                old = lse[:, :, qs]
                new = torch.logaddexp(old, block_lse)
                keep = torch.exp(old - new).nan_to_num(0.0)[..., None]
                take = torch.exp(block_lse - new).nan_to_num(0.0)[..., None]
                out[:, :, qs] = out[:, :, qs] * keep + o * take
                lse[:, :, qs] = new
            if step < ring.n - 1:
                kb, vb = _unpack(ring.pass_on(_pack(kb, vb)), (kb, vb))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.group, ctx.scale, ctx.window = split, group, scale, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        split, scale = ctx.split, ctx.scale
        ring = _Ring(ctx.group)
        qi = split.index[ring.rank]
        dout = dout.float()
        delta = (dout * out).sum(-1)  # rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kb, vb = k, v
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(ring.n):
            for qs, ks, mask in _pairs(split, qi, split.index[ring.source(step)], ctx.window):
                qf, kf, vf = q[:, :, qs].float(), kb[:, :, ks].float(), vb[:, :, ks].float()
                s = (qf @ kf.transpose(-1, -2)) * scale
                p = torch.exp(s - lse[:, :, qs, None]).masked_fill(~mask, 0.0).nan_to_num(0.0)
                do = dout[:, :, qs]
                dv[:, :, ks] += p.transpose(-1, -2) @ do
                ds = p * (do @ vf.transpose(-1, -2) - delta[:, :, qs, None])
                dq[:, :, qs] += (ds @ kf) * scale
                dk[:, :, ks] += (ds.transpose(-1, -2) @ qf) * scale
            # the block moves on with the gradients gathered for it so far; after the last
            # step its gradients alone make the final hop home to their owner
            if step < ring.n - 1:
                kb, vb, dk, dv = _unpack(ring.pass_on(_pack(kb, vb, dk, dv)), (kb, vb, dk, dv))
            else:
                dk, dv = _unpack(ring.pass_on(_pack(dk, dv)), (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: Split,
                   group: dist.ProcessGroup, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens ([B, H, S/N, D]) to the whole sequence over the ring;
    returns [B, H, S/N, D]."""
    k, v = (repeat_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    return _RingAttention.apply(q, k, v, split, group, scale, window)  # type: ignore[no-any-return,no-untyped-call]
