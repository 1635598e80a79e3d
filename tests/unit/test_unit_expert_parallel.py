"""Expert parallelism's refusals, each one line, raised before any process group or model work:
the strategies and layouts this version does not split experts under, and the models it cannot."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError, EngineConfig
from shardwise.distributed.mesh import ParallelDims
from shardwise.strategies.expert_parallel import check_layout, expert_parallel_step


def _dims(**sizes: int) -> ParallelDims:
    shape = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 1, "ep": 2, **sizes}
    world = shape["dp_replicate"] * shape["dp_shard"] * shape["tp"] * shape["cp"]
    return ParallelDims(world_size=world, **shape)


def _one_line(err: pytest.ExceptionInfo[BaseException], *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


@pytest.mark.parametrize(("strategy", "backend", "sizes", "words"), [
    ("ddp", "torch", {}, ("zero1, zero2 or zero3", "ddp")),
    ("zero3", "deepspeed", {}, ("deepspeed", "backend: torch")),
    ("zero3", "torch", {"tp": 2}, ("tensor parallelism",)),
])
def test_layouts_refused(strategy: str, backend: str, sizes: dict[str, int], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        check_layout(_dims(**sizes), strategy, backend)
    _one_line(err, "expert_parallel_size=2", *words)


def test_hybrid_sharding_at_ep_the_sharding_group_is_a_layout() -> None:
    check_layout(_dims(dp_replicate=2), "zero3", "torch")  # 2 replicas of 2, ep 2: each replica splits
    check_layout(_dims(dp_replicate=2), "zero1", "torch")
    check_layout(_dims(dp_replicate=2, dp_shard=4), "zero3", "torch")  # ep 2 below the group of 4


def test_zero1_is_a_layout() -> None:
    check_layout(_dims(), "zero1", "torch")  # DDP leaves the split experts out
    check_layout(_dims(dp_shard=4), "zero1", "torch")  # ep 2 x data 2: the holders split their steps


def test_ep_one_is_nothing() -> None:
    check_layout(_dims(ep=1), "ddp", "deepspeed")
    assert expert_parallel_step(nn.Linear(2, 2), _dims(ep=1)) == []


class Experts(nn.Module):
    def __init__(self, experts: int, transposed: bool = False) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(experts, 4, 4))
        self.is_transposed = self.has_bias = transposed


@pytest.mark.parametrize(("model", "words"), [
    (nn.Sequential(nn.Linear(4, 4)), ("no mixture-of-experts layer",)),
    (nn.Sequential(Experts(3)), ("does not divide", "3 experts")),
    (nn.Sequential(Experts(4, transposed=True)), ("transposed", "GPT-OSS")),
])
def test_models_refused(model: nn.Module, words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        expert_parallel_step(model, _dims())
    _one_line(err, "expert_parallel_size=2", *words)


def test_config_keys() -> None:
    cfg = EngineConfig.of(strategy="zero3", expert_parallel_size=2)
    assert cfg.parallelism.ep == 2
    with pytest.raises(ConfigError) as err:
        EngineConfig.of(strategy="zero3", expert_parallel_size=2, parallelism={"ep": 4})
    _one_line(err, "disagree")
    assert EngineConfig.of(strategy="auto", expert_parallel_size=2).parallelism.ep == 2  # the planner plans
    with pytest.raises(ConfigError) as err:
        EngineConfig.of(expert_parallel_size=0)
    _one_line(err, "integer >= 1")
