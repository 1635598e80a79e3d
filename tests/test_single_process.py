"""Started without a launcher, the engine is a world of size one and every strategy still runs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise
import workloads as W

RUN = dict(batch=4, accum=2, steps=2)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_world_of_one_matches_plain_pytorch(strategy: str) -> None:
    run = W.train_engine("tiny", {"cpu": True, "strategy": strategy}, **RUN)
    ref = W.reference("tiny", world=1, **RUN)
    assert W.close(run["losses"], ref["losses"]) < 1e-5
    assert W.max_diff(run["state"], ref["state"]) < 2e-5


def test_dataloader_order_is_seeded_and_reshuffles_per_epoch() -> None:
    engine = shardwise.Engine(cpu=True, seed=3)
    loader = engine.prepare(DataLoader(list(range(10)), batch_size=5, shuffle=True))
    first = [b.tolist() for b in loader]
    second = [b.tolist() for b in loader]  # a new pass is a new epoch
    loader.set_epoch(0)
    again = [b.tolist() for b in loader]
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    assert sum(first, []) == expected
    assert first == again and first != second
    assert sorted(sum(second, [])) == list(range(10))


def test_batches_land_on_the_engine_device() -> None:
    engine = shardwise.Engine(cpu=True)
    data = [{"x": torch.ones(2), "meta": "a"} for _ in range(4)]
    loader = engine.prepare(DataLoader(data, batch_size=2))
    batch = next(iter(loader))
    assert batch["x"].device == engine.device and batch["meta"] == ["a", "a"]


def test_save_model_writes_loadable_safetensors(tmp_path) -> None:
    from safetensors.torch import load_file

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = engine.prepare(W.build("tiny"))
    engine.save_model(model, tmp_path / "out")
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert W.max_diff(loaded, W.build("tiny").state_dict()) == 0.0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_save_model_transformers_roundtrip(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = engine.prepare(W.build("gpt2"))
    engine.save_model(model, tmp_path / "gpt2")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    ids = W.Tokens(2).data
    with torch.no_grad():
        assert torch.equal(back(ids).logits, W.build("gpt2")(ids).logits)
