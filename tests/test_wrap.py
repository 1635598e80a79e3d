"""Which submodules become FSDP units (plain function, no process group needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted_here
from torch import nn

from shardwise import ConfigError
from shardwise.strategies import find_blocks


def _benchmarks_common() -> Any:
    """benchmarks/common.py by its path (examples/ has a `common` module too, which another test
    may have imported under that name first)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("benchmarks_common", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeated_blocks_are_detected_but_not_their_mlp() -> None:
    bench = _benchmarks_common()
    GPT, Block = bench.GPT, bench.Block  # blocks whose MLP is Sequential(Linear, GELU, Linear)

    model = GPT(layers=3)
    blocks = find_blocks(model)
    assert [type(b) for b in blocks] == [Block] * 3


def test_transformers_hint_is_used() -> None:
    blocks = find_blocks(W.build("gpt2"))
    assert [type(b).__name__ for b in blocks] == ["GPT2Block", "GPT2Block"]


def test_own_model_blocks() -> None:
    assert [type(b) for b in find_blocks(W.build("tiny"))] == [W.Block] * 3


def test_explicit_wrap_by_class_and_name() -> None:
    model = W.build("tiny")
    assert len(find_blocks(model, (nn.LayerNorm,))) == 4  # 3 block norms + the final norm
    assert len(find_blocks(model, ("Linear",))) == 7


def test_no_repeated_blocks_means_root_only() -> None:
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []


def test_explicit_wrap_matching_nothing_names_the_classes() -> None:
    with pytest.raises(ConfigError, match=r"its module classes are: .*TinyLM"):
        find_blocks(W.build("tiny"), ("LlamaDecoderLayer",))


def _saved_bytes(model: nn.Module) -> int:
    import torch

    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        W.lm_loss(model, W.Tokens(16).data).backward()
    return total


def test_activation_checkpointing_keeps_fewer_activations_and_same_grads() -> None:
    check_fewer_activations()


def test_planted_checkpoint_first_block_only_is_caught() -> None:
    """`checkpoint_first_block_only`: one block checkpointed; the saved bytes stay above half."""
    with planted_here("checkpoint_first_block_only"):
        caught(check_fewer_activations,
               must=r"^the checkpointed blocks keep \d+ bytes for backward, the plain model \d+: "
                    r"not under half")


def check_fewer_activations() -> None:
    from shardwise.strategies import apply_activation_checkpointing

    plain, ckpt = W.build("tiny"), W.build("tiny")
    apply_activation_checkpointing(find_blocks(ckpt))
    kept_plain, kept_ckpt = _saved_bytes(plain), _saved_bytes(ckpt)
    assert kept_ckpt < 0.5 * kept_plain, \
        f"the checkpointed blocks keep {kept_ckpt} bytes for backward, the plain model {kept_plain}: " \
        "not under half"
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
