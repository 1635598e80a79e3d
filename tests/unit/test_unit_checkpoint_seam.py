"""The checkpoint's seam, in one process: a checkpoint asks its owners of tensor state only for
the members `shardwise.checkpoint.parts` names (plain objects with them save and load a
checkpoint, no strategy or runner involved), and the placements a checkpoint writes a strided
split as (`shardwise.distributed.internals.one_block_placements`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from shardwise.checkpoint import sharded
from shardwise.checkpoint.parts import Parts
from shardwise.distributed.arrival import alone
from shardwise.distributed.internals import is_strided_shard, one_block_placements, strided_shard


class _Weights:
    """A model-state owner that is no strategy: the module's own state dict."""

    shard_group_size = 1

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return dict(model.state_dict())

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        model.load_state_dict(state)


class _Moments:
    """An optimizer-state owner that is no runner: one tensor of state, kept as given back."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.moment = torch.arange(4.0)
        self.loaded: dict[str, Any] | None = None

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        return {"moment": self.moment.clone()}

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.loaded = state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose
def test_any_owners_with_the_seams_members_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    runner = _Moments(torch.optim.SGD(model.parameters(), lr=0.1))
    info = {"backend": "torch", "strategy": "ddp", "offload": "none", "precision": "fp32"}
    parts = Parts(models=[model], unwrapped=[model], runners=[runner], optimizer_models=[0],
                  loop_state={"step": 3}, strategy=_Weights(), info=info, rank=0, world=1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with alone():
        sharded.save(parts, tmp_path / "ckpt")
        meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
        assert meta["shard_group_size"] == 1 and meta["optimizers"] == [{"model": 0, "class": "SGD"}]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        runner.moment = torch.zeros(4)  # the load template; the checkpoint's values come back
        assert sharded.load(parts, tmp_path / "ckpt") == {"step": 3}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert runner.loaded is not None and torch.equal(runner.loaded["moment"], torch.arange(4.0))


@pytest.mark.parametrize(("placements", "expected"), [
    ([Shard(0)], None),  # one block already
    ([Replicate(), Shard(1)], None),
    ([strided_shard(0, 3)], [Shard(0)]),  # a fused q/k/v split over tp: runs, written as one block
    ([Shard(0), strided_shard(0, 3)], [Shard(0), Shard(0)]),  # dp shard, then the fused split
    ([strided_shard(0, 2), Shard(0)], None),  # FSDP2 over a tp shard of the same dimension: one block
    ([strided_shard(0, 3), Shard(1)], [Shard(0), Shard(1)]),
    ([Replicate(), strided_shard(1, 3)], [Replicate(), Shard(1)]),
])
def test_a_strided_split_is_written_as_one_block(placements: list[Placement],
                                                 expected: list[Placement] | None) -> None:
    got = one_block_placements(placements)
    assert got == expected
    if got is not None:
        assert not any(is_strided_shard(p) for p in got)
