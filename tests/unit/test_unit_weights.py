"""Weights in and out, in one process: tied weights kept in one sharding unit, tied names in
the files, sizes, and the key matching of `load_model` (`shardwise.strategies.blocks`,
`shardwise.weights.export`, `shardwise.weights.loading`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from shardwise.checkpoint.storage import CheckpointError
from shardwise.strategies.blocks import find_blocks, keep_ties_whole
from shardwise.weights.export import drop_aliases, find_aliases, parse_size
from shardwise.weights.loading import check_source


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=16, max_position_embeddings=8))


def test_a_block_holding_a_tied_weight_is_left_to_the_unit_above() -> None:
    model = _bert()
    blocks = find_blocks(model)
    assert any(type(b).__name__ == "BertEmbeddings" for b in blocks)  # transformers lists it
    kept = keep_ties_whole(model, blocks)
    assert [type(b).__name__ for b in kept] == ["BertLayer", "BertLayer"]


class _Stack(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_blocks_without_ties_are_all_kept() -> None:
    model = _Stack(tied=True)
    blocks = find_blocks(model)
    assert len(blocks) == 2 and keep_ties_whole(model, blocks) == blocks


def test_a_tie_between_two_blocks_leaves_both_to_the_root() -> None:
    model = _Stack(tied=False)
    model.blocks[1][0].weight = model.blocks[0][0].weight
    assert keep_ties_whole(model, find_blocks(model)) == []


def test_tied_names_point_to_the_first_and_are_written_once() -> None:
    model = _Stack(tied=True)
    aliases = find_aliases(model)
    assert aliases == {"head.weight": "embed.weight"}
    assert "head.weight" not in drop_aliases(model.state_dict(), aliases)


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), (1000, 1000),
                                            ("2 kb", 2000)])
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


def test_a_bad_size_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"write e\.g\. 5GB"):
        parse_size("five gigs")


def _saved(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path


def test_keys_under_a_wrappers_prefix_match(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    folder = _saved(tmp_path, {f"module.{k}": v for k, v in model.state_dict().items()})
    _, found = check_source(folder, model, strict=True)
    assert sorted(found) == ["bias", "weight"]


def test_an_unknown_prefix_is_refused_naming_key_map_and_key_map_renames_it(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    folder = _saved(tmp_path, {f"encoder.{k}": v for k, v in model.state_dict().items()})
    with pytest.raises(CheckpointError, match="key_map") as err:
        check_source(folder, model, strict=True)
    assert "\n" not in str(err.value)
    _, found = check_source(folder, model, strict=True, key_map={"encoder.": ""})
    assert sorted(found) == ["bias", "weight"]


def test_a_mis_shaped_key_is_refused_by_name(tmp_path: Path) -> None:
    folder = _saved(tmp_path, {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"mis-shaped weight \[2, 4\] vs \[2, 3\]"):
        check_source(folder, nn.Linear(3, 2), strict=True)


def _moe(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(
            vocab_size=16, hidden_size=8, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4))
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=16, hidden_size=8, moe_intermediate_size=6, shared_expert_intermediate_size=4,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2))


@pytest.mark.parametrize("family", ["mixtral", "qwen"])
def test_experts_stored_one_by_one_are_read_fused(tmp_path: Path, family: str) -> None:
    """A transformers 5 MoE checkpoint in the per-expert layout, as its own save_pretrained writes
    it (Mixtral: `block_sparse_moe.experts.N.w1/w2/w3`; Qwen2-MoE: `mlp.experts.N.gate_proj/
    up_proj/down_proj`), read into the fused experts module: every key matched (none left over),
    each fused tensor, whole and by a range of experts (a rank's split), bit for bit the model's."""
    from safetensors import safe_open

    from shardwise.weights.loading import make_reader

    model = _moe(family)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    _, found = check_source(tmp_path, model, strict=True)
    read = make_reader(found)
    state = model.state_dict()
    assert found.keys() == state.keys() - set(find_aliases(model))
    fused = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4
    for key in state.keys() - set(find_aliases(model)):
        assert torch.equal(read(key, None), state[key]), key
    for key in fused:
        assert torch.equal(read(key, slice(2, 4)), state[key][2:4]), key
        out = torch.empty_like(state[key][1:3])
        read(key, slice(1, 3), out)
        assert torch.equal(out, state[key][1:3]), key


def test_experts_stored_one_by_one_that_differ_are_refused_in_one_line(tmp_path: Path) -> None:
    model = _moe("qwen")
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(5, 8)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"behind model\.layers\.1\.mlp\.experts\.gate_up") as err:
        check_source(tmp_path, model, strict=True)
    assert "\n" not in str(err.value)
