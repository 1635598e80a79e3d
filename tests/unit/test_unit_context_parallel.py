"""Context parallelism's logic that needs no process group: the splits, the mask of each block,
the ring's balance over the causal mask, the config's refusals (each one line)."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError, EngineConfig
from shardwise.strategies.attention import Split, _pairs, contiguous_index, zigzag_index


@pytest.mark.parametrize("n", [2, 4])
def test_the_splits_cover_every_position_once(n: int) -> None:
    seq = 8 * n
    for index in (zigzag_index(seq, n), contiguous_index(seq, n)):
        assert sorted(torch.cat(index).tolist()) == list(range(seq))
        assert all(len(i) == seq // n for i in index)
    zig = zigzag_index(seq, n)
    chunk = seq // (2 * n)
    assert zig[0].tolist() == [*range(chunk), *range(seq - chunk, seq)]  # chunks 0 and 2n-1


def _split(batch: int, seq: int, n: int, valid: torch.Tensor | None = None,
           doc: torch.Tensor | None = None) -> Split:
    return Split(zigzag_index(seq, n),
                 torch.ones(batch, seq, dtype=torch.bool) if valid is None else valid,
                 torch.zeros(batch, seq, dtype=torch.long) if doc is None else doc, chunk=seq // (2 * n))


def test_a_blocks_mask_is_the_whole_masks_slice() -> None:
    """Causal in sequence order, key padding, documents: each block's mask is the one-process
    mask (causal & same document & valid key) at those positions."""
    g = torch.Generator().manual_seed(0)
    seq, n = 16, 2
    valid = torch.rand(2, seq, generator=g) > 0.2
    doc = (torch.rand(2, seq, generator=g) > 0.8).long().cumsum(-1)
    split = _split(2, seq, n, valid, doc)
    every = torch.arange(seq)
    causal = (every[None, :] <= every[:, None])[None]
    whole = causal & (doc[:, :, None] == doc[:, None, :]) & valid[:, None, :]
    for q in split.index:
        for k in split.index:
            assert torch.equal(split.block_mask(q, k)[:, 0], whole[:, q][:, :, k])


@pytest.mark.parametrize("n", [2, 4])
def test_the_zigzag_ring_gives_every_rank_the_same_work(n: int) -> None:
    """Under the causal mask each rank computes as many chunk pairs as every other over the ring's
    blocks, each of the same size (the zigzag's point: no rank idles), the fully masked ones
    skipped, and as many unmasked scores; a contiguous split would leave them uneven."""
    seq = 8 * n
    split = _split(1, seq, n)
    pairs, scores = [], []
    for q in split.index:
        computed = [(qs, ks, m) for k in split.index for qs, ks, m in _pairs(split, q, k)]
        pairs.append(sorted((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in computed))
        scores.append(sum(int(m.sum()) for _, _, m in computed))
    assert all(p == pairs[0] for p in pairs) and len(pairs[0]) == 2 * n + 1  # (of 4n it could pair)
    assert len(set(scores)) == 1 and sum(scores) == seq * (seq + 1) // 2
    contiguous = Split(contiguous_index(seq, n), split.valid, split.doc)
    uneven = [sum(int(m.sum()) for k in contiguous.index for _, _, m in _pairs(contiguous, q, k))
              for q in contiguous.index]
    assert len(set(uneven)) == n  # (a contiguous split: the last rank does the most)


@pytest.mark.parametrize(("config", "message"), [
    ({"context_parallel_size": 0}, "context_parallel_size=0 must be an integer >= 1"),
    ({"context_parallel_size": 2, "parallelism": {"cp": 4}},
     "parallelism.cp=4 and context_parallel_size=2 disagree"),
    ({"context_parallel": "tree"}, "context_parallel='tree' must be ring or ulysses"),
    ({"strategy": "auto", "context_parallel_size": 2}, "strategy: auto with context_parallel_size=2"),
    ({"tiled_mlp": "yes"}, "tiled_mlp='yes' must be true, false or None"),
    ({"tile_tokens": 0}, "tile_tokens=0 must be an integer >= 1"),
])
def test_bad_context_settings_are_refused_in_one_line(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        EngineConfig.of(**config)
    assert "\n" not in str(refused.value)


def test_the_flat_key_and_the_section_read_the_same() -> None:
    assert EngineConfig.of(context_parallel_size=2).parallelism.cp == 2
    assert EngineConfig.of(parallelism={"cp": 2}).context_parallel_size == 2
