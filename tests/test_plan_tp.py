"""The planner's tensor-parallel candidates: traced through the real TP code on fake ranks (a 2-D
(dp, tp) mesh of the fake process group), their communication, the flag, and strategy="auto"."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shardwise import cli
from shardwise.plan import Candidate, PlanRequest, plan_named
from shardwise.plan.comm import step_comm, tensor_parallel_bytes, with_tensor_parallel
from shardwise.plan.fit import comm_factor
from shardwise.plan.planner import layout
from shardwise.plan.presets import PlanError

# a tiny Llama whose blocks hold almost all of its weights: hidden 128, 4 layers
HIDDEN, LAYERS, INTER, VOCAB, SEQ = 128, 4, 256, 64, 32


def _llama(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }))
    return path


def _gpt2(tmp_path: Path) -> Path:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64,
                                "n_positions": 64, "n_embd": 64, "n_layer": 4, "n_head": 2}))
    return path


# -- arithmetic (no trace) --------------------------------------------------------------------------
def test_tp_all_reduce_bytes_and_ring_factor() -> None:
    # 2 rowwise layers per block x 4 blocks, forward and backward, batch 2 x seq 32 x hidden 128, fp32
    full = tensor_parallel_bytes(2 * LAYERS, 2, SEQ, HIDDEN, 4)
    assert full == 2 * 8 * 2 * 32 * 128 * 4 == 524288
    dp = step_comm("zero3", 1e6, "fp32", world_size=4)  # the data-parallel part over world / tp = 4
    vol = with_tensor_parallel(dp, full, tp=2)
    assert vol.intra["all_reduce"] - dp.intra["all_reduce"] == pytest.approx(full * 2 * (2 - 1) / 2)
    assert vol.intra["all_gather"] == dp.intra["all_gather"] and vol.inter == dp.inter
    assert with_tensor_parallel(dp, full, tp=4).intra["all_reduce"] - dp.intra["all_reduce"] == 1.5 * full
    # a traced collective's key names its group: "@2" two consecutive ranks, "@4:2" four ranks 2 apart
    assert comm_factor("allreduce@2", 8) == 1.0 and comm_factor("allgather_base@4:2", 8) == 0.75
    assert comm_factor("allreduce", 8) == 1.75


def test_tp_candidates_names_settings_and_layouts() -> None:
    c = Candidate("zero3", tensor_parallel_size=2)
    assert c.name == "zero3 + tp 2"
    assert Candidate("ddp", "none", "full", tensor_parallel_size=4).name == "ddp + tp 4 + AC"
    req = PlanRequest(world_size=4, device_memory="8GB", tensor_parallel_size=2,
                      activation_checkpointing="none")
    tp = [x for x in req.chosen() if x.tensor_parallel_size == 2]
    plain = PlanRequest(world_size=4, device_memory="8GB", activation_checkpointing="none").chosen()
    assert [(x.strategy, x.offload) for x in tp] == [(x.strategy, x.offload) for x in plain]  # every one
    assert len(req.chosen()) == 2 * len(plain)
    hybrid = PlanRequest(world_size=8, nodes=2, device_memory="8GB", tensor_parallel_size=2,
                         activation_checkpointing="none").chosen()
    # every hybrid plan (groups of a node's 4 devices) has a tp twin: groups of 4 / 2 = 2 dp ranks
    twins = [x for x in hybrid if x.tensor_parallel_size == 2 and x.shard_group_size is not None]
    assert [(x.strategy, x.offload) for x in twins] == [
        (x.strategy, x.offload) for x in hybrid if x.tensor_parallel_size == 1 and x.shard_group_size == 4]
    assert twins and {x.shard_group_size for x in twins} == {2}
    assert twins[0].name.startswith("zero1 hybrid 2 + tp 2")
    # zero1 on one data-parallel rank is ddp's layout: traced once
    assert layout(Candidate("zero1"), 1) == Candidate("ddp")
    assert layout(Candidate("zero1"), 2) == Candidate("zero1")
    assert layout(Candidate("zero1", "optimizer"), 1).strategy == "zero1"


@pytest.mark.parametrize("kw, message", [
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size 0 must be an integer >= 1"),
    ({"tensor_parallel_size": 3}, "--tensor-parallel-size 3 does not divide the 4 devices"),
    ({"tensor_parallel_size": 4, "nodes": 2},
     "--tensor-parallel-size 4 does not divide the 2 devices per node"),
    ({"candidates": [Candidate("zero3", shard_group_size=3, tensor_parallel_size=2)]},
     "shard_group_size=3 does not divide the 2 data-parallel ranks"),
    ({"sequence_parallel": True}, "--sequence-parallel splits the activations over the tensor-parallel"),
])
def test_request_refuses_bad_tp_sizes(kw: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        PlanRequest(world_size=4, device_memory="8GB", **kw).check()  # type: ignore[arg-type]


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt2", "--gpus", "4", "--tensor-parallel-size", "3"],
     "--tensor-parallel-size 3 does not divide the 4 devices"),
    (["--model", "gpt2", "--tensor-parallel-size", "0"], "--tensor-parallel-size 0 must be an integer >= 1"),
    (["--model", "deberta-v2-xlarge", "--gpus", "2", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size 2: deberta-v2-xlarge has no tensor-parallel plan"),
])
def test_cli_refuses_bad_tp_in_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.plan import planner

    monkeypatch.setattr(planner, "_trace_candidates", lambda *a, **k: pytest.fail("traced despite bad input"))
    assert cli.main(["plan", "--gpu-memory", "24GB", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# -- traced through the real TP code ----------------------------------------------------------------
def _block_and_rest(tp: int) -> tuple[int, int]:
    """(elements a tp rank holds of the planned weights, elements of the rest) of the tiny Llama."""
    attn, mlp = 4 * HIDDEN * HIDDEN, 3 * HIDDEN * INTER
    planned = LAYERS * (attn + mlp)
    rest = 2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN  # embedding, head, RMSNorms
    return planned // tp, rest


def test_tp_candidates_hold_their_share_and_all_reduce_the_activations(tmp_path: Path) -> None:
    """ddp + tp 2 on 2 devices: Adam's state (two fp32 moments per element a rank holds) is the
    planned weights' half plus the rest, exactly; the all-reduces are 2 per block, forward and
    backward; zero3 + tp 2 at 4 devices shards that over the 2 data-parallel ranks."""
    cands = [Candidate("ddp"), Candidate("ddp", tensor_parallel_size=2), Candidate("zero3"),
             Candidate("zero3", tensor_parallel_size=2), Candidate("zero1", tensor_parallel_size=2),
             Candidate("zero2", "optimizer", tensor_parallel_size=2)]
    req = PlanRequest(world_size=4, device_memory="1GB", batch=2, device="cpu", candidates=cands)
    plan = plan_named(str(_llama(tmp_path)), req, seq_len=SEQ)
    ddp, ddp_tp = plan.find("ddp"), plan.find("ddp", tensor_parallel_size=2)
    z3, z3_tp = plan.find("zero3"), plan.find("zero3", tensor_parallel_size=2)
    half, rest = _block_and_rest(2)
    whole, _ = _block_and_rest(1)
    assert ddp.breakdown["optimizer"] == pytest.approx(8 * (whole + rest), rel=1e-3)
    assert ddp_tp.breakdown["optimizer"] == pytest.approx(8 * (half + rest), rel=1e-3)
    assert 0.5 < ddp_tp.breakdown["optimizer"] / ddp.breakdown["optimizer"] < 0.56  # about half
    # zero3: 1/4 of everything, vs tp 2 x dp 2: (half + rest) / 2
    assert z3.breakdown["optimizer"] == pytest.approx(8 * (whole + rest) / 4, rel=0.02)
    assert z3_tp.breakdown["optimizer"] == pytest.approx(8 * (half + rest) / 2, rel=0.02)
    # zero1 under tp: the tp share's optimizer state split over the 2 replicas of each tp rank;
    # zero2 + optimizer offload under tp: the same state, stepped on the host (a CPU target's
    # device memory is the host's: counted where it lives, as zero2 + tp 2 would hold it)
    z1_tp = plan.find("zero1", tensor_parallel_size=2)
    assert z1_tp.breakdown["optimizer"] == pytest.approx(8 * (half + rest) / 2, rel=0.02)
    off_tp = plan.find("zero2", "optimizer", tensor_parallel_size=2)
    assert off_tp.breakdown["optimizer"] == pytest.approx(8 * (half + rest) / 2, rel=0.02)
    assert ddp_tp.settings()["tensor_parallel_size"] == 2 and "tensor_parallel_size" not in ddp.settings()
    # TP's all-reduces: sent over the 2 tp ranks on top of the data-parallel collectives
    tp_sent = ddp_tp.comm.intra["all_reduce"] - step_comm(  # type: ignore[union-attr]
        "ddp", half + rest, "fp32", world_size=2).intra["all_reduce"]
    # per block: o_proj's and down_proj's outputs in forward, and in backward the input gradient of
    # each colwise layer torch's ColwiseParallel splits separately (q, k, v, gate, up): 7 all-reduces
    # of batch x seq x hidden (a fused qkv as GPT-2's: 2 + 2, `tensor_parallel_bytes`)
    assert tp_sent == 7 * LAYERS * 2 * SEQ * HIDDEN * 4 == 917504


def test_sequence_parallel_candidates_gather_and_scatter_instead_and_hold_fewer_activations(
    tmp_path: Path,
) -> None:
    """zero3 + tp 2 + sp at 4 devices: the same parameters and optimizer state as zero3 + tp 2; no
    tp all-reduce left, instead per block 4 all-gathers (the attention's and the MLP's input in
    forward, the rowwise outputs' gradients in backward) and 4 reduce-scatters (the rowwise
    outputs in forward, the inputs' gradients in backward) of batch x seq x hidden, plus the
    residual stream's gather after the last block (forward) and at the first (backward); and
    fewer activations (the norms and residuals hold half the tokens). What stays all-reduced over
    the tp pair: the norms' weight gradients (each rank's from its half of the tokens)."""
    cands = [Candidate("zero3", tensor_parallel_size=2),
             Candidate("zero3", tensor_parallel_size=2, sequence_parallel=True)]
    req = PlanRequest(world_size=4, device_memory="1GB", batch=2, device="cpu", candidates=cands)
    plan = plan_named(str(_llama(tmp_path)), req, seq_len=SEQ)
    tp = plan.find("zero3", tensor_parallel_size=2)
    sp = plan.find("zero3", tensor_parallel_size=2, sequence_parallel=True)
    assert sp.name == "zero3 + tp 2 + sp" and sp.settings()["sequence_parallel"] is True
    assert sp.breakdown["optimizer"] == tp.breakdown["optimizer"]
    assert sp.breakdown["params"] == tp.breakdown["params"]
    assert sp.breakdown["activations"] < tp.breakdown["activations"]
    one = 2 * SEQ * HIDDEN * 4  # batch x seq x hidden, fp32
    dp = step_comm("zero3", sum(_block_and_rest(2)), "fp32", world_size=2)
    assert sp.comm is not None and tp.comm is not None
    norms = 2 * LAYERS * HIDDEN * 4  # each block's two RMSNorm weights, fp32
    assert sp.comm.intra["all_reduce"] - dp.intra["all_reduce"] == pytest.approx(norms * 2 * (2 - 1) / 2)
    ring = (2 - 1) / 2
    sent = {kind: sp.comm.intra[kind] - dp.intra[kind] for kind in ("reduce_scatter", "all_gather")}
    assert sent["reduce_scatter"] == pytest.approx(4 * LAYERS * one * ring)
    assert sent["all_gather"] == pytest.approx((4 * LAYERS + 2) * one * ring)


def test_hybrid_sharding_with_tp_is_traced_on_the_3d_mesh(tmp_path: Path) -> None:
    """8 devices on 2 nodes, tp 2: zero3 hybrid 2 + tp 2 (each node's 2 data-parallel ranks shard,
    the nodes replicate) holds twice the optimizer state of zero3 + tp 2 (sharded over all 4
    data-parallel ranks); TP's all-reduces stay within a node and are the same bytes as without
    hybrid; across nodes only the replicas' gradient all-reduce (1/2 of what a tp rank holds)."""
    cands = [Candidate("zero3", tensor_parallel_size=2),
             Candidate("zero3", shard_group_size=2, tensor_parallel_size=2)]
    req = PlanRequest(world_size=8, nodes=2, device_memory="1GB", batch=2, device="cpu", candidates=cands)
    plan = plan_named(str(_llama(tmp_path)), req, seq_len=SEQ)
    full, hybrid = plan.find("zero3", tensor_parallel_size=2), plan.find("zero3", shard_group_size=2,
                                                                        tensor_parallel_size=2)
    half, rest = _block_and_rest(2)
    assert full.breakdown["optimizer"] == pytest.approx(8 * (half + rest) / 4, rel=0.02)
    assert hybrid.breakdown["optimizer"] == pytest.approx(8 * (half + rest) / 2, rel=0.02)
    tp_bytes = 7 * LAYERS * 2 * SEQ * HIDDEN * 4  # as `test_tp_candidates_hold_their_share...`
    dp_full = step_comm("zero3", half + rest, "fp32", world_size=4, nodes=2)
    dp_hybrid = step_comm("zero3", half + rest, "fp32", world_size=4, nodes=2, group_size=2)
    for run, dp in ((full, dp_full), (hybrid, dp_hybrid)):
        assert run.comm is not None
        assert run.comm.intra["all_reduce"] - dp.intra.get("all_reduce", 0.0) == pytest.approx(tp_bytes)
    assert hybrid.comm is not None and full.comm is not None
    assert hybrid.comm.inter == pytest.approx(dp_hybrid.inter)
    assert hybrid.comm.inter_bytes < full.comm.inter_bytes
    assert hybrid.settings() == {"strategy": "zero3", "offload": "none", "activation_checkpointing": "none",
                                 "shard_group_size": 4, "tensor_parallel_size": 2}  # the config's: processes


def test_one_process_traces_world_after_world_with_the_right_groups(tmp_path: Path) -> None:
    """Traces run one after another in one process (a worker of `shardwise plan`): each fake world
    makes its own process groups, and DTensor's cached shardings (keyed by a mesh's shape, not its
    groups) are dropped between worlds, so a later trace's TP all-reduces name its own tp group
    (before: the earlier world's group of the same name, counted as a data-parallel collective)."""
    from shardwise.plan.planner import _trace_candidates
    from shardwise.plan.presets import resolve_model

    cands = [Candidate("zero3", shard_group_size=2, tensor_parallel_size=2),
             Candidate("zero3", tensor_parallel_size=2)]
    req = PlanRequest(world_size=8, nodes=2, device_memory="1GB", batch=2, device="cpu", candidates=cands)
    spec = resolve_model(str(_llama(tmp_path)), SEQ)
    traces = _trace_candidates(spec, cands, req, batch=2, grad_accum_steps=1)
    for cand in cands:
        keys = set(traces[cand][(None, 2)].comm_bytes)
        assert "allreduce@2" in keys and not {"allreduce", "allreduce@4:2"} & keys, (cand.name, keys)


def test_cli_lists_tp_candidates_at_about_half_the_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.perf_counter()
    code = cli.main(["plan", "--model", str(_gpt2(tmp_path)), "--seq-len", "32", "--gpus", "2",
                     "--gpu-memory", "64MB", "--cuda-context", "1MB", "--nccl-buffers", "1MB",
                     "--no-activation-checkpointing", "--tensor-parallel-size", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    lines = text.splitlines()
    head = next(line for line in lines if line.startswith("plan "))
    cols = head[31:].split()  # after the 30-wide name column and its mark
    rows = {line[1:31].strip(): dict(zip(cols, line[31:].split())) for line in lines
            if line[1:].startswith(("ddp", "zero"))}
    assert {"ddp + tp 2", "zero2 + tp 2", "zero3 + tp 2"} <= set(rows), text
    # Adam's state: 2 fp32 moments per element the rank holds
    ddp, ddp_tp = float(rows["ddp"]["optim"]), float(rows["ddp + tp 2"]["optim"])
    assert 0.45 < ddp_tp / ddp < 0.7, text  # GPT-2's embeddings (an eighth here) stay whole
    assert time.perf_counter() - t0 < 120


# -- strategy="auto" -------------------------------------------------------------------------------
def test_auto_takes_tensor_parallelism_only_when_no_zero_plan_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide activations (batch 8 x seq 64, MLP 1024) on a small model: tp 2 splits them, ZeRO does
    not. With room for a ZeRO plan auto takes it; with less than the leanest ZeRO plan needs but
    what tp 2 needs, it takes tp 2 and sets tensor_parallel_size."""
    import torch
    import transformers
    from torch.utils.data import DataLoader

    from shardwise.config import EngineConfig
    from shardwise.distributed.world import DistInfo
    from shardwise.plan import auto, plan_module

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    data = [{"input_ids": torch.randint(0, 64, (64,)), "labels": torch.randint(0, 64, (64,))}
            for _ in range(8)]
    loader = DataLoader(data, batch_size=8)
    info = DistInfo(0, 2, 0, 2, torch.device("cpu"))
    engine_cfg = EngineConfig.of(strategy="auto", cpu=True)
    monkeypatch.setattr(auto, "device_memory", lambda _info: 64 * 2**30)
    out, plan = auto.choose(engine_cfg, info, [model], [loader])
    assert out.tensor_parallel_size == 1 and plan.best is not None
    assert all(p.candidate.tensor_parallel_size == 1 for p in plan.plans)  # a ZeRO plan fits: TP not planned
    zero = min(p.peak for p in plan.plans)
    tp = min(p.peak for p in plan_module(model, auto.sample_batch(loader), PlanRequest(
        world_size=2, device_memory="64GB", device="cpu",
        candidates=[Candidate(s, tensor_parallel_size=2) for s in ("ddp", "zero2", "zero3")])).plans)
    assert tp < 0.95 * zero, (tp, zero)  # the premise: tp 2 needs less than any plan without
    monkeypatch.setattr(auto, "device_memory", lambda _info: int((zero + tp) / 2))
    out, plan = auto.choose(engine_cfg, info, [model], [loader])
    assert out.tensor_parallel_size == 2 and out.strategy in ("ddp", "zero2", "zero3"), plan.why
    assert plan.best is not None and plan.best.name.endswith("+ tp 2")
