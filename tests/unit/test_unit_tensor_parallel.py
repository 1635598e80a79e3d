"""Tensor parallelism's plans and refusals, in one process (`shardwise.strategies.tensor_parallel`,
the config's checks of `tensor_parallel_size`)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import workloads as W
from torch import nn

from shardwise.config import EngineConfig
from shardwise.config.parallelism import check_tp as check_tensor_parallel
from shardwise.config.tree import ConfigError
from shardwise.engine.data import first_samples
from shardwise.strategies.tensor_parallel import (
    _check_sizes,
    _matches,
    _sequence_layout,
    model_plan,
    trial_sequence_shapes,
)


def test_a_transformers_model_brings_its_plan_under_its_base_prefix() -> None:
    plan = model_plan(W.build("llama"), None)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise" and len(plan) == 7
    assert model_plan(W.build("llama"), {"model.layers.*.mlp.up_proj": "colwise"}) == {
        "model.layers.*.mlp.up_proj": "colwise"}  # the user's wins
    assert model_plan(W.build("tiny"), None) == {}  # no plan: refused at prepare


def test_a_plan_pattern_matches_every_layer_and_must_name_something() -> None:
    model = W.build("llama")
    found = _matches({"model.layers.*.mlp.up_proj": "colwise"}, model)
    assert found == {"model.layers.0.mlp.up_proj": "colwise", "model.layers.1.mlp.up_proj": "colwise"}
    with pytest.raises(ConfigError) as refused:
        _matches({"layers.*.mlp.up": "colwise"}, model)
    assert W.one_line(refused.value).startswith(
        "tensor_parallel_plan: 'layers.*.mlp.up' names no module of LlamaForCausalLM")


def test_heads_and_split_dimensions_must_divide() -> None:
    model = W.build("llama")  # 4 heads, 2 key/value heads, hidden 32, intermediate 64
    modules = _matches(model_plan(model, None), model)
    _check_sizes(model, modules, 2)
    with pytest.raises(ConfigError) as refused:
        _check_sizes(model, modules, 4)
    assert W.one_line(refused.value).startswith(
        "tensor_parallel_size=4 does not divide LlamaForCausalLM's num_key_value_heads=2")
    lone = nn.Sequential(nn.Linear(6, 9))
    with pytest.raises(ConfigError) as refused:
        _check_sizes(lone, {"0": "colwise"}, 2)
    assert W.one_line(refused.value).startswith(
        "tensor_parallel_size=2 does not divide 0's (9, 6) weight (colwise: dimension 0)")


@pytest.mark.parametrize(("settings", "message"), [
    ({"strategy": "zero3", "backend": "deepspeed"}, "DeepSpeed trains AutoTP only up to ZeRO-2; use zero2"),
    ({"strategy": "zero3", "tensor_parallel_plan": {"x": "sideways"}}, "must map module paths to one of"),
])
def test_what_tensor_parallelism_does_not_compose_with_is_refused_in_one_line(settings: dict,
                                                                             message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        EngineConfig.of(tensor_parallel_size=2, **settings)
    assert message in W.one_line(refused.value)


# (strategy, offload) -> what dp 2 x tp 2 builds: the FSDP2 stage, replicas only (ddp's memory),
# the optimizer sharded over the replicas (zero1), the mesh (dp_replicate, dp_shard, tp), how the
# optimizer steps (its runner, the partition, on the host) and the parameters offloaded
COMPOSED: dict[tuple[str, str], tuple[int, bool, bool, tuple[int, int, int], str, bool]] = {
    ("ddp", "none"): (0, True, False, (2, 1, 2), "InPlaceRunner", False),
    ("zero1", "none"): (1, True, True, (2, 1, 2), "ShardedOptimizer flat", False),
    ("zero2", "none"): (2, False, False, (1, 2, 2), "InPlaceRunner", False),
    ("zero3", "none"): (3, False, False, (1, 2, 2), "InPlaceRunner", False),
    ("zero1", "optimizer"): (1, True, True, (2, 1, 2), "ShardedOptimizer flat host", False),
    ("zero2", "optimizer"): (2, False, False, (1, 2, 2), "ShardedOptimizer local host", False),
    ("zero3", "optimizer"): (3, False, False, (1, 2, 2), "ShardedOptimizer local host", False),
    ("zero3", "params"): (3, False, False, (1, 2, 2), "InPlaceRunner", True),
}


@pytest.mark.parametrize(("strategy", "offload"), list(COMPOSED))
def test_every_strategy_and_offload_compose_with_tensor_parallelism(strategy: str, offload: str) -> None:
    """What the composition builds, rank 0 of 4 fake processes (dp 2 x tp 2, the planner's fake
    world: real strategies, no communication): the strategy, its mesh, the Llama's q_proj split
    over tp and then over the dp shards (the norm over the dp shards only), the optimizer's
    runner and the parameter offload."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    from shardwise.distributed.world import DistInfo
    from shardwise.plan.fakes import fake_world
    from shardwise.strategies import make_strategy
    from shardwise.strategies.steps import parallelize

    stage, replicas_only, shard_optimizer, sizes, runner_kind, params_offloaded = COMPOSED[strategy, offload]
    cfg = EngineConfig.of(tensor_parallel_size=2, strategy=strategy, offload=offload)
    info = DistInfo(rank=0, world_size=4, local_rank=0, local_world_size=4, device=torch.device("cpu"))
    with fake_world(4):
        built = make_strategy(cfg, info)
        assert type(built).__name__ == "FSDPStrategy"  # torch's DDP takes no DTensor parameters
        assert (built.stage, built.replicas_only, built.shard_optimizer) == (stage, replicas_only,
                                                                            shard_optimizer)
        dims = built.dims
        assert (dims.dp_replicate, dims.dp_shard, dims.tp) == sizes and dims.tp == 2
        assert built.dims.tp_mesh.mesh_dim_names == ("tp",) and built.dims.tp_mesh.size() == 2
        model = W.build("llama")
        parallelize(model, dims, built.cfg.parallelism, cfg.blocks, own_steps=built.own_steps)
        model = built.setup_model(model)
        params = dict(model.named_parameters())
        q, norm = params["model.layers.0.self_attn.q_proj.weight"], params["model.norm.weight"]
        dp_shard = sizes[1]
        assert "tp" in q.device_mesh.mesh_dim_names and "tp" not in norm.device_mesh.mesh_dim_names
        assert q.placements[q.device_mesh.mesh_dim_names.index("tp")].is_shard(0), q.placements
        assert tuple(q.to_local().shape) == (32 // 2 // dp_shard, 32), q.to_local().shape
        assert tuple(norm.to_local().shape) == (32 // dp_shard,), norm.to_local().shape
        policy = model._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy) == params_offloaded, policy
        runner = built.make_runner(W.make_optimizer(model))
        kind = " ".join([type(runner).__name__, getattr(runner, "partition", "") or "",
                         "host" if getattr(runner, "host", False) else ""]).split()
        assert " ".join(kind) == runner_kind, kind
        if shard_optimizer:  # each tp rank's elements split over its 2 replicas (not over all 4)
            assert runner.world == 2, runner.world


@pytest.mark.parametrize(("strategy", "offload"),
                         [("zero1", "none"), ("zero2", "none"), ("zero2", "optimizer")])
def test_deepspeed_stages_compose_with_autotp(strategy: str, offload: str) -> None:
    """On DeepSpeed, tensor parallelism is its AutoTP: the config handed to deepspeed.initialize
    asks for it (autotp_size 2) with the ZeRO stage and offload of the strategy."""
    import torch

    from shardwise.strategies.deepspeed.setup import deepspeed_config

    cfg = EngineConfig.of(tensor_parallel_size=2, strategy=strategy, offload=offload, backend="deepspeed")
    ds = deepspeed_config(cfg, device=torch.device("cpu"), numel=1000)
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    assert ds["zero_optimization"]["stage"] == int(strategy[-1])
    assert ("offload_optimizer" in ds["zero_optimization"]) == (offload == "optimizer")


def test_tp_must_divide_the_world_and_stay_within_a_node() -> None:
    check_tensor_parallel(2, 8, 4)  # divides the world and the node: no refusal
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(4, 6, 6)
    assert W.one_line(refused.value).startswith(
        "tensor_parallel_size=4 does not divide the 6 processes of this run")
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(4, 12, 6)
    assert W.one_line(refused.value).startswith(
        "tensor_parallel_size=4 does not divide the 6 processes per node: its all-reduces would cross nodes")


def test_the_mesh_puts_tp_innermost_and_splits_data_over_dp_ranks() -> None:
    import torch

    from shardwise.distributed.world import DistInfo
    from shardwise.strategies.base import Strategy, layout

    info = DistInfo(rank=0, world_size=8, local_rank=0, local_world_size=8, device=torch.device("cpu"))
    cfg = EngineConfig.of(strategy="zero3", shard_group_size=4, tensor_parallel_size=2)
    dims = layout(cfg, info, shards=True, supported=Strategy.supported_dims)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 2)
    assert dims.names == ("dp_replicate", "dp_shard", "tp") and dims.dp_size == 4
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # a tp pair: one batch
    assert [dims.tp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_throughput_counts_a_tp_groups_batch_once() -> None:
    """The processes of a tp group see the same batch: samples and tokens per second count it once
    (the loss, a mean over the processes' equal losses, stays)."""
    import torch

    from shardwise.distributed.world import DistInfo
    from shardwise.runtime.metrics import Meter

    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    records = []
    for copies in (1, 2):
        meter = Meter(info, 1, peak=None, flops_per_token=None, same_samples=lambda copies=copies: copies)
        meter.on_batch(torch.zeros(4, 8, dtype=torch.long))  # 4 samples of 8 tokens
        meter.on_backward(torch.tensor(2.0))
        meter.due(1)
        records.append(meter.record(1, None, {}))
    one, two = records
    assert two["loss"] == one["loss"] == 2.0
    # samples per second x seconds per step (one step): the samples each record counted
    assert abs(one["samples_per_s"] * one["step_time_s"] - 4) < 1e-9
    assert abs(two["samples_per_s"] * two["step_time_s"] - 2) < 1e-9
    assert abs(two["tokens_per_s"] / two["samples_per_s"] - 8) < 1e-9


# -- sequence parallelism -------------------------------------------------------------------------
@pytest.mark.parametrize(("settings", "message"), [
    ({"tensor_parallel_size": 1}, "sequence_parallel: true splits the activations over the tensor-parallel"),
    ({"tensor_parallel_size": 2, "strategy": "zero2", "backend": "deepspeed"},
     "DeepSpeed's AutoTP has no sequence parallelism; use backend: torch"),
])
def test_sequence_parallel_without_tp_or_on_deepspeed_is_refused_in_one_line(settings: dict,
                                                                            message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        EngineConfig.of(sequence_parallel=True, **settings)
    assert message in W.one_line(refused.value)
    assert EngineConfig.of(sequence_parallel=True, tensor_parallel_size=2).parallelism.sequence_parallel


def test_sequence_parallel_cuts_at_the_blocks_sublayers_and_norms() -> None:
    """GPT-2 and Llama: the residual stream split at the first block and gathered after the last,
    each attention and MLP gathering its input, the norms between them on this rank's tokens."""
    gpt2 = W.build("gpt2")
    layout = _sequence_layout(gpt2, _matches(model_plan(gpt2, None), gpt2))
    assert layout.blocks == ["transformer.h.0", "transformer.h.1"]
    assert layout.sublayers == ["transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1.attn",
                                "transformer.h.1.mlp"]
    assert layout.norms == ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1",
                            "transformer.h.1.ln_2"]
    llama = W.build("llama")
    layout = _sequence_layout(llama, _matches(model_plan(llama, None), llama))
    assert layout.blocks == ["model.layers.0", "model.layers.1"]
    assert [n.rsplit(".", 1)[1] for n in layout.norms] == ["input_layernorm", "post_attention_layernorm"] * 2


def test_sequence_parallel_refuses_a_model_it_cannot_cut() -> None:
    """The project's GPT projects q/k/v straight from its block (no attention module of its own);
    a block holding other whole parameters than norms is refused too."""
    gpt = W.build("gpt")
    with pytest.raises(ConfigError) as refused:
        _sequence_layout(gpt, _matches(model_plan(gpt, None), gpt))
    assert W.one_line(refused.value).startswith(
        "sequence_parallel: each block's attention and MLP must be modules of their own")
    llama = W.build("llama")
    llama.model.layers[0].register_parameter("gate", nn.Parameter(llama.model.norm.weight.detach().clone()))
    with pytest.raises(ConfigError) as refused:
        _sequence_layout(llama, _matches(model_plan(llama, None), llama))
    assert W.one_line(refused.value).startswith(
        "sequence_parallel: model.layers.0 (LlamaDecoderLayer) holds whole parameters")


class _Drawing(torch.utils.data.Dataset):
    """Samples that draw from python's, numpy's and torch's generators as they are read (random
    augmentations do): reading them for a trial must not change what the run draws next."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = random.random() + float(np.random.rand()) + float(torch.rand(()))
        return torch.full((4, 8), float(i)) + 0 * noise


def test_the_trial_batch_reads_the_first_samples_and_leaves_the_generators_and_sampler_alone() -> None:
    loader = torch.utils.data.DataLoader(_Drawing(), batch_size=3, shuffle=True)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = random.random(), float(np.random.rand()), float(torch.rand(())), list(loader.sampler)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    batch = first_samples(loader)
    after = random.random(), float(np.random.rand()), float(torch.rand(())), list(loader.sampler)
    assert before == after
    assert batch.shape == (2, 4, 8) and batch[:, 0, 0].tolist() == [0.0, 1.0]
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(4)

    iterable = torch.utils.data.DataLoader(Stream(), batch_size=2)
    assert first_samples(iterable) is None  # reading it may consume it: no trial


META = torch.device("meta")  # the trial's batch: the loader's samples moved to the meta device


def test_the_trial_forward_refuses_a_pooled_mlp_and_leaves_the_model_unsplit() -> None:
    class Block(nn.Module):
        def __init__(self, pooled: bool = True) -> None:
            super().__init__()
            self.pooled = pooled
            self.attn = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(x)
            return self.mlp(x.mean(1) if self.pooled else x)

    model = nn.Sequential(Block())
    plan = {"0.*.0": "colwise", "0.*.1": "rowwise"}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as refused:
        trial_sequence_shapes(model, plan, 2, (torch.randn(2, 4, 8, device=META),
                                               torch.randn(2, device=META)))
    said = W.one_line(refused.value)
    assert said.startswith("sequence_parallel: 0.mlp gets hidden states of shape (2, 8)"), said
    assert all(torch.equal(v, weights[k]) and v.device.type == "cpu" for k, v in model.state_dict().items())
    assert not model[0]._forward_pre_hooks and not model[0].mlp._forward_pre_hooks  # the copy's hooks only
    with pytest.raises(ConfigError, match="sequence length 5 does not divide by tensor_parallel_size=2"):
        trial_sequence_shapes(model, plan, 2, torch.randn(2, 5, 8, device=META))
    trial_sequence_shapes(nn.Sequential(Block(pooled=False)), plan, 2, torch.randn(2, 4, 8, device=META))
