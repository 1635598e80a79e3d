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


def test_experts_stored_one_by_one_are_refused_naming_transformers_loader(tmp_path: Path) -> None:
    """A transformers 5 MoE checkpoint in the per-expert layout (Mixtral's w1/w2/w3, as
    transformers' own save_pretrained writes it), checked against the fused experts module:
    one line saying what the layout is and how to load it, not a key_map hint."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    model = MixtralForCausalLM(config)
    model.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="experts one by one") as err:
        check_source(tmp_path, model, strict=True)
    text = str(err.value)
    assert "\n" not in text and "from_pretrained" in text and "key_map" not in text
