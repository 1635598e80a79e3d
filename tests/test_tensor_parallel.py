"""Tensor parallelism composed with ZeRO, against one plain process (fp32).

A tiny transformers Llama (its own `base_model_tp_plan`: q/k/v and gate/up colwise, o and down
rowwise; embeddings, norms and the head whole) trained under `tensor_parallel_size: 2`:
  2 processes   tp 2 (one data-parallel rank) with zero2 and zero3: losses and clipped gradient
                norms within 1e-5, final weights within 2e-5 (measured up to 5.8e-6) of one process on
                the same batches;
                each rank holds exactly its plan's share of the parameters (the planned weights
                halved, the rest whole); the checkpoint saved under tp 2 loads under zero3 without
                tp (and back) bit-identical; `save_model` writes what transformers'
                `from_pretrained` loads in a plain process, and `load_model` reads it back into
                tp shards, bit-identical;
  4 processes   dp 2 x tp 2 with zero2, zero3 and hybrid zero3 (2 replicas of groups of one dp
                rank) (FSDP2 over the dp mesh, the tp pairs split each
                layer), also zero1 (its optimizer state split over each tp rank's replicas), zero1
                and zero2 with optimizer offload, zero3 with parameter offload: the same checks
                against one process with the global batch; every rank holds exactly its share of
                the parameters and of AdamW's moments (`_held`: measured from the storages its
                optimizer's state_dict reaches); `gather` and a summing `reduce` count each
                data-parallel rank once (a tp pair holds the same data).
GPT-2 on its built-in plan (the fused query/key/value Conv1D split per third by heads): tp 2 with
ddp and zero3 at 2 processes and dp 2 x tp 2 with zero2 at 4, the same checks; its tp checkpoint
into zero3 without tp and its export into transformers, bit-identical.
Tolerances: TP changes the order of the sums inside a matmul (each rank sums half the inner
dimension, then the all-reduce adds the halves), a few ulps per step in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch.utils.data import DataLoader

BATCH, STEPS = 2, 4
PLANNED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class TPRun:
    """One tensor-parallel run: losses (averaged over processes), clipped norms, the final full
    weights (gathered on process 0), the parameter elements this rank holds, the batches its
    loader served, the loss's type (a DTensor under loss parallelism); at 4 processes what
    `gather` of the data-parallel rank, a summing and a mean `reduce` returned; the elements of
    AdamW's moments this rank holds (`W.adam_state_elements`). `model` is the prepared model, in
    the worker only (`sent` drops it: it does not travel back)."""

    losses: list[float]
    norms: list[float]
    state: dict[str, torch.Tensor]
    local: int
    batches: int
    loss_type: str = ""
    gathered: list[int] = field(default_factory=list)
    summed: list[float] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    adam: int = 0
    model: Any = None

    def sent(self, **more: Any) -> TPRun:
        """The record as it travels back from a worker (without the model), with `more` set."""
        return replace(self, model=None, **more)


@dataclass(frozen=True, slots=True)
class Moved:
    """A checkpoint loaded elsewhere: the step load_state returned, the gathered weights then."""

    step: int
    state: dict[str, torch.Tensor]


def _prepared(engine: Any, dp: int, name: str = "llama") -> tuple[Any, Any, Any]:
    """The tiny Llama (or GPT-2), its AdamW and a loader of STEPS global batches of dp * BATCH, prepared."""
    model = W.build(name)
    opt = W.make_optimizer(model)
    data = W.Tokens(dp * BATCH * STEPS)
    return engine.prepare(model, opt, DataLoader(data, batch_size=BATCH, shuffle=True))


def _train(engine: Any, dp: int, name: str = "llama") -> TPRun:
    """STEPS optimizer steps of the tiny Llama (or GPT-2) on `engine`; dp data-parallel ranks share a
    global batch of dp * BATCH (the processes of a tp group take the same one)."""
    model, opt, loader = _prepared(engine, dp, name)
    losses, norms = [], []
    for ids in loader:
        with engine.loss_parallel():  # (a head planned colwise_loss_parallel: split logits)
            loss = W.lm_loss(model, ids)
            engine.backward(loss)
        losses.append(engine.reduce(loss.detach(), "mean").item())
        norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return TPRun(losses, norms, engine.get_state_dict(model), local, len(loader), type(loss).__name__,
                 adam=W.adam_state_elements(opt), model=model)


def _two(folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    import shardwise

    out: dict[str, Any] = {}
    for strategy in ("ddp", "zero2", "zero3"):
        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, tensor_parallel_size=2,
                                  checkpoint_dir=f"{folder}/{strategy}")
        run = _train(engine, dp=1)
        if strategy == "zero3":
            engine.save_state()
            engine.save_model(run.model, f"{folder}/export")  # whole tensors, as transformers loads
        out[strategy] = run.sent()
        engine.free_memory()
    # a user's plan that splits the embedding and the head too (transformers' full Llama plan)
    from shardwise.strategies.tensor_parallel import model_plan

    plan = {**model_plan(W.build("llama"), None), "model.embed_tokens": "embedding_rowwise",
            "lm_head": "colwise_gather_output"}
    engine = shardwise.Engine(strategy="zero2", cpu=True, seed=W.SEED, tensor_parallel_size=2,
                              tensor_parallel_plan=plan)
    run = _train(engine, dp=1)
    out["full plan"] = run.sent()
    engine.free_memory()
    # loss parallelism: the head's logits split over the vocabulary, the loss computed on them
    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, tensor_parallel_size=2,
                              tensor_parallel_plan={**plan, "lm_head": "colwise_loss_parallel"})
    run = _train(engine, dp=1)
    out["loss parallel"] = run.sent()
    engine.free_memory()
    # the tp 2 checkpoint into zero3 without tp, and that one back into tp 2
    plain = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, checkpoint_dir=f"{folder}/zero3")
    model, _opt, _loader = _prepared(plain, dp=2)
    out["into_zero3"] = Moved(plain.load_state(), plain.get_state_dict(model))
    plain.save_state(f"{folder}/from_zero3")
    back = shardwise.Engine(strategy="zero2", cpu=True, seed=W.SEED, tensor_parallel_size=2)
    model, _opt, _loader = _prepared(back, dp=1)
    out["into_tp"] = Moved(back.load_state(f"{folder}/from_zero3"), back.get_state_dict(model))
    # the exported weights straight into tp shards of a freshly built model
    model, _opt, _loader = _prepared(back, dp=1)
    back.load_model(model, f"{folder}/export")
    out["loaded"] = back.get_state_dict(model)
    out["rank"] = dist.get_rank()
    out.update(_gpt2(folder))
    return out


def _gpt2(folder: str) -> dict[str, Any]:
    """GPT-2 on its built-in plan (fused c_attn split per third by heads, Conv1D weights): tp 2
    with ddp and zero3, its checkpoint into zero3 without tp, its export."""
    import shardwise

    out: dict[str, Any] = {}
    for strategy in ("ddp", "zero3"):
        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, tensor_parallel_size=2,
                                  checkpoint_dir=f"{folder}/gpt2_{strategy}")
        run = _train(engine, dp=1, name="gpt2")
        if strategy == "zero3":
            engine.save_state()
            engine.save_model(run.model, f"{folder}/gpt2_export")
        out[f"gpt2 {strategy}"] = run.sent()
        engine.free_memory()
    # the project's own GPT (examples/gpt.py), on the plan it carries (fused qkv: colwise_qkv)
    engine = shardwise.Engine(strategy="zero2", cpu=True, seed=W.SEED, tensor_parallel_size=2)
    run = _train(engine, dp=1, name="gpt")
    out["gpt zero2"] = run.sent()
    engine.free_memory()
    plain = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, checkpoint_dir=f"{folder}/gpt2_zero3")
    model, _opt, _loader = _prepared(plain, dp=2, name="gpt2")
    out["gpt2 into_zero3"] = Moved(plain.load_state(), plain.get_state_dict(model))
    out.update(_empty(folder))
    return out


def _empty(folder: str) -> dict[str, Any]:
    """Models built under init_empty() and split by tp 2: every planned weight initialized from the
    constructor's own draws, this rank's part only; from_pretrained reads each rank's part of the
    export straight into its tp shards."""
    from transformers import GPT2LMHeadModel

    import shardwise

    out: dict[str, Any] = {}
    for name in ("llama", "gpt2", "gpt"):
        for strategy in ("ddp", "zero3"):
            engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, tensor_parallel_size=2)
            with engine.init_empty():
                model = W.build(name)
            model = engine.prepare(model)
            out[f"empty {name} {strategy}"] = engine.get_state_dict(model)
            engine.free_memory()
    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, tensor_parallel_size=2)
    model = engine.prepare(engine.from_pretrained(GPT2LMHeadModel, f"{folder}/gpt2_export"))
    out["gpt2 from_pretrained"] = engine.get_state_dict(model)
    return out


# case -> (model, strategy, offload, shard_group_size); hybrid: groups of 2 processes (one tp pair,
# one dp rank), 2 replicas
FOUR = {"ddp": ("llama", "ddp", "none", None), "zero1": ("llama", "zero1", "none", None),
        "zero1 offload": ("llama", "zero1", "optimizer", None), "zero2": ("llama", "zero2", "none", None),
        "zero2 offload": ("llama", "zero2", "optimizer", None), "zero3": ("llama", "zero3", "none", None),
        "zero3 offload params": ("llama", "zero3", "params", None),
        "zero3 hybrid": ("llama", "zero3", "none", 2), "gpt2 zero2": ("gpt2", "zero2", "none", None)}


def _four(folder: str, cases: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every case of FOUR, the zero1 and zero3 checkpoints saved and zero1's resumed under zero3
    without tp; only `cases` (trained, nothing saved) where given."""
    import torch.distributed as dist

    import shardwise

    out: dict[str, Any] = {}
    for case in cases or FOUR:
        name, strategy, offload, group = FOUR[case]
        engine = shardwise.Engine(strategy=strategy, offload=offload, cpu=True, seed=W.SEED,
                                  tensor_parallel_size=2, shard_group_size=group,
                                  checkpoint_dir=f"{folder}/four_{case.replace(' ', '_')}")
        run = _train(engine, dp=2, name=name)
        # the processes of a tp pair hold the same data: gathered and summed once
        dp_rank = torch.tensor([dist.get_rank() // 2])
        out[case] = run.sent(gathered=engine.gather(dp_rank).tolist(),
                             summed=engine.reduce(torch.tensor([1.0, 2.0]), "sum").tolist(),
                             mean=engine.reduce(dp_rank.float(), "mean").tolist())
        if case in ("zero1", "zero3") and cases is None:
            engine.save_state()
        engine.free_memory()
    if cases is not None:
        return out
    # zero1 under dp 2 x tp 2 (its optimizer state split over the replicas of each tp rank) into
    # zero3 without tp at 4
    plain = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, checkpoint_dir=f"{folder}/four_zero1")
    model, _opt, _loader = _prepared(plain, dp=4)
    out["zero1 into_zero3"] = Moved(plain.load_state(), plain.get_state_dict(model))
    return out


# the resume matrix: the dp 2 x tp 2 zero3 checkpoint (saved by `_four`) into zero3 at 2, tp 2 at
# 2 and ddp at 1, each saving again; those three back into dp 2 x tp 2 (`_back_to_four`)
ELSEWHERE = {"zero3 at 2": (2, "zero3", 1), "tp 2 at 2": (2, "zero2", 2), "ddp at 1": (1, "ddp", 1)}


def _from_four(folder: str, world: int) -> dict[str, Moved]:
    import shardwise

    out: dict[str, Moved] = {}
    for case, (size, strategy, tp) in ELSEWHERE.items():
        if size != world:
            continue
        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, tensor_parallel_size=tp,
                                  checkpoint_dir=f"{folder}/four_zero3")
        model, _opt, _loader = _prepared(engine, dp=world // tp)
        out[case] = Moved(engine.load_state(), engine.get_state_dict(model))
        engine.save_state(f"{folder}/elsewhere_{case.replace(' ', '_')}")
        engine.free_memory()
    return out


def _back_to_four(folder: str) -> dict[str, Moved]:
    import shardwise

    out: dict[str, Moved] = {}
    for case in ELSEWHERE:
        engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, tensor_parallel_size=2)
        model, _opt, _loader = _prepared(engine, dp=2)
        out[case] = Moved(engine.load_state(f"{folder}/elsewhere_{case.replace(' ', '_')}"),
                          engine.get_state_dict(model))
        engine.free_memory()
    return out


def _reference(dp: int, name: str = "llama") -> W.Trained:
    return W.reference(name, world=dp, batch=BATCH, accum=1, steps=STEPS, clip=1.0)


def tp_share(name: str, split: Callable[[str], bool], dp_shard: int = 1) -> int:
    """Parameters one rank holds of model `name`: those `split(parameter name)` names halved over
    tp 2, the rest whole, then every parameter over the dp_shard ranks (FSDP2 pads a shard to equal
    size: counted as it is laid out)."""
    model = W.build(name)
    halved = sum(p.numel() for n, p in model.named_parameters() if split(n))
    return (halved // 2 + sum(p.numel() for p in model.parameters()) - halved) // dp_shard


def _planned(name: str) -> bool:
    """A Llama parameter its own plan splits."""
    return name.split(".")[-2] in PLANNED


def _share(dp_shard: int) -> int:
    """The tiny Llama's parameters on one rank of its own plan (`tp_share`)."""
    return tp_share("llama", _planned, dp_shard)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp2")


@pytest.fixture(scope="module")
def two(folder: Path) -> list[dict[str, Any]]:
    return spawn(_two, 2, str(folder))


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_tp2_matches_one_process(two: list[dict[str, Any]], strategy: str) -> None:
    ref = _reference(dp=1)
    assert W.max_diff(two[0][strategy].state, ref.state) < 2e-5  # (gathered on process 0; measured 5.8e-6)
    for rank in two:
        run = rank[strategy]
        assert run.batches == STEPS  # both tp ranks took every batch: one data-parallel rank
        assert W.close(run.losses, ref.losses) < 1e-5
        assert W.close(run.norms, ref.norms) < 1e-5
        assert run.local == _share(1)  # the plan's share: planned weights halved, the rest whole
        assert run.adam == 2 * _share(1)  # AdamW's two moments of that share (one dp rank: all of it)


@pytest.mark.parametrize("case", ["full plan", "loss parallel"])
def test_a_users_plan_splitting_embedding_and_head_matches_one_process(two: list[dict[str, Any]],
                                                                      case: str) -> None:
    """transformers' full Llama plan (embedding and head split too); and with loss parallelism,
    the logits never whole on a rank: the cross-entropy runs on the split logits."""
    ref = _reference(dp=1)
    for rank in two:
        run = rank[case]
        assert W.close(run.losses, ref.losses) < 1e-5 and W.close(run.norms, ref.norms) < 1e-5
        model = W.build("llama")
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        whole = sum(p.numel() for p in model.parameters())
        assert run.local == (whole - norms) // 2 + norms  # all but the norms split: embedding, head too
    assert W.max_diff(two[0][case].state, ref.state) < 1e-5
    if case == "loss parallel":  # the loss came from split logits: a DTensor
        assert {rank[case].loss_type for rank in two} == {"DTensor"}


def test_a_tp_checkpoint_resumes_without_tp_and_back(two: list[dict[str, Any]]) -> None:
    for rank in two:
        assert rank["into_zero3"].step == STEPS and rank["into_tp"].step == STEPS
    trained = two[0]["zero3"].state  # (gathered on process 0)
    assert W.max_diff(two[0]["into_zero3"].state, trained) == 0.0
    assert W.max_diff(two[0]["into_tp"].state, trained) == 0.0


def test_exported_weights_load_in_transformers_and_into_tp_shards(two: list[dict[str, Any]],
                                                                   folder: Path) -> None:
    from transformers import LlamaForCausalLM

    trained = two[0]["zero3"].state
    plain = LlamaForCausalLM.from_pretrained(folder / "export")  # one plain process
    assert W.max_diff(dict(plain.state_dict()), trained) == 0.0
    assert W.max_diff(two[0]["loaded"], trained) == 0.0  # load_model into a tp 2 model's shards


# case -> how each rank's parameters and AdamW state are split over the 2 data-parallel ranks:
# "whole" (each holds its tp share), "shard" (FSDP2's split of each parameter's dim 0), "flat"
# (zero1: the tp share's elements end to end, rank r updating the r-th range of ceil(share / 2))
SPLIT = {"ddp": ("whole", "whole"), "zero1": ("whole", "flat"), "zero1 offload": ("whole", "flat"),
         "zero2": ("shard", "shard"), "zero2 offload": ("shard", "shard"), "zero3": ("shard", "shard"),
         "zero3 offload params": ("shard", "shard"), "zero3 hybrid": ("whole", "whole"),
         "gpt2 zero2": ("shard", "shard")}


def _held(case: str, rank: int) -> tuple[int, int]:
    """The parameter elements and AdamW moment elements (exp_avg and exp_avg_sq: twice the
    elements it updates) process `rank` of dp 2 x tp 2 holds under `case`, derived from the plan:
    its tp share (`tp_share`), whole or halved (FSDP2: every dim 0 of these models divides by
    tp x dp = 4, so each rank holds exactly half, no padding), or zero1's flat range."""
    name = FOUR[case][0]
    share = _share(1) if name == "llama" else _gpt2_share()
    assert all(p.shape[0] % 4 == 0 for p in W.build(name).parameters())
    dp_rank, chunk = rank // 2, -(-share // 2)
    part = {"whole": share, "shard": share // 2, "flat": max(0, min(chunk, share - dp_rank * chunk))}
    params, optimizer = SPLIT[case]
    return part[params], 2 * part[optimizer]


def _check_dp2_x_tp2(four: list[dict[str, Any]], case: str) -> None:
    """dp 2 x tp 2 under `case` against one process with the global batch: losses, norms and
    final weights within 1e-5; metrics counting data-parallel ranks; every rank holding exactly
    its share of the parameters and of AdamW's state (`_held`)."""
    ref = _reference(dp=2, name=FOUR[case][0])
    for rank in four:
        run = rank[case]
        assert run.batches == STEPS
        assert W.close(run.losses, ref.losses) < 1e-5
        assert W.close(run.norms, ref.norms) < 1e-5
    assert W.max_diff(four[0][case].state, ref.state) < 1e-5
    for rank in four:  # metrics count data-parallel ranks, not processes
        assert rank[case].gathered == [0, 1]
        assert rank[case].summed == [2.0, 4.0] and rank[case].mean == [0.5]
    held = [(rank[case].local, rank[case].adam) for rank in four]
    expected = [_held(case, r) for r in range(len(four))]
    assert held == expected, (f"{case}: (parameter, AdamW state) elements per rank {held}, "
                              f"its share {expected}")


@pytest.mark.parametrize("case", list(FOUR))
def test_dp2_x_tp2_matches_one_process(case: str, four: list[dict[str, Any]]) -> None:
    _check_dp2_x_tp2(four, case)


def test_zero1_keeping_the_whole_optimizer_state_is_caught(tmp_path: Path) -> None:
    """Planted `zero1_whole_optimizer_state`: zero1 under dp 2 x tp 2 with every rank stepping
    (and keeping the AdamW state of) every element of its tp share, the weights still right; the
    dp 2 x tp 2 check must fail on the state each rank holds."""
    four = spawn(planted(_four, "zero1_whole_optimizer_state"), 4, str(tmp_path), ("zero1",))
    caught(_check_dp2_x_tp2, four, "zero1",
           must=r"^zero1: \(parameter, AdamW state\) elements per rank \[\(13472, 26944\), \(13472, 26944\), "
                r"\(13472, 26944\), \(13472, 26944\)\], its share \[\(13472, 13472\)")


def test_a_zero1_tp_checkpoint_resumes_under_zero3_without_tp(four: list[dict[str, Any]]) -> None:
    for rank in four:
        assert rank["zero1 into_zero3"].step == STEPS
    assert W.max_diff(four[0]["zero1 into_zero3"].state, four[0]["zero1"].state) == 0.0


@pytest.fixture(scope="module")
def four(folder: Path) -> list[dict[str, Any]]:
    return spawn(_four, 4, str(folder))


def test_a_dp2_x_tp2_checkpoint_resumes_at_other_layouts_and_back(four: list[dict[str, Any]],
                                                                   folder: Path) -> None:
    """The dp 2 x tp 2 zero3 checkpoint loads under zero3 at 2 (no tp), tp 2 at 2 (one dp rank) and
    ddp at 1 process, each bit-identical; what each of those saves loads back under dp 2 x tp 2,
    bit-identical again."""
    trained = four[0]["zero3"].state  # (gathered on process 0)
    elsewhere = {**spawn(_from_four, 2, str(folder), 2)[0], **spawn(_from_four, 1, str(folder), 1)[0]}
    assert set(elsewhere) == set(ELSEWHERE)
    for case, moved in elsewhere.items():
        assert moved.step == STEPS, case
        assert W.max_diff(moved.state, trained) == 0.0, case
    back = spawn(_back_to_four, 4, str(folder))
    for rank in back:
        assert {case: moved.step for case, moved in rank.items()} == dict.fromkeys(ELSEWHERE, STEPS)
    for case, moved in back[0].items():
        assert W.max_diff(moved.state, trained) == 0.0, case


def _gpt2_share() -> int:
    """GPT-2's parameters on one tp rank of its built-in plan: the c_attn and c_fc weights, c_fc's
    bias and the two c_proj weights halved; embeddings, norms, c_attn's fused bias and the c_proj
    biases whole."""
    return tp_share("gpt2", lambda n: n.endswith(("c_attn.weight", "c_fc.weight", "c_fc.bias",
                                                   "c_proj.weight")))


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_gpt2_on_its_built_in_plan_matches_one_process(two: list[dict[str, Any]], strategy: str) -> None:
    """GPT-2's fused query/key/value Conv1D split per third by heads: exact against one process."""
    ref = _reference(dp=1, name="gpt2")
    for rank in two:
        run = rank[f"gpt2 {strategy}"]
        assert run.batches == STEPS
        assert W.close(run.losses, ref.losses) < 1e-5 and W.close(run.norms, ref.norms) < 1e-5
        assert run.local == _gpt2_share()
    assert W.max_diff(two[0][f"gpt2 {strategy}"].state, ref.state) < 1e-5


def test_gpt2_tp_checkpoint_and_export(two: list[dict[str, Any]], folder: Path) -> None:
    """The GPT-2 tp 2 checkpoint resumes under zero3 without tp bit-identical (the fused weight's
    global layout is the model's own), and its export loads in transformers."""
    from transformers import GPT2LMHeadModel

    trained = two[0]["gpt2 zero3"].state
    for rank in two:
        assert rank["gpt2 into_zero3"].step == STEPS
    assert W.max_diff(two[0]["gpt2 into_zero3"].state, trained) == 0.0
    plain = GPT2LMHeadModel.from_pretrained(folder / "gpt2_export")
    assert W.max_diff(dict(plain.state_dict()), trained) == 0.0


def test_the_projects_own_gpt_on_the_plan_it_carries_matches_one_process(two: list[dict[str, Any]]) -> None:
    """examples/gpt.py's `tensor_parallel_plan` (its fused qkv Linear split per third by heads)."""
    ref = _reference(dp=1, name="gpt")
    share = tp_share("gpt", lambda n: n.endswith(("qkv.weight", "proj.weight", "mlp.0.weight", "mlp.0.bias",
                                                   "mlp.2.weight")))
    for rank in two:
        run = rank["gpt zero2"]
        assert W.close(run.losses, ref.losses) < 1e-5 and W.close(run.norms, ref.norms) < 1e-5
        assert run.local == share
    assert W.max_diff(two[0]["gpt zero2"].state, ref.state) < 1e-5


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt"])
def test_init_empty_under_tp_gives_a_normal_builds_weights(two: list[dict[str, Any]], name: str) -> None:
    built = W.build(name).state_dict()
    for strategy in ("ddp", "zero3"):
        assert W.max_diff(two[0][f"empty {name} {strategy}"], dict(built)) == 0.0, strategy


def test_from_pretrained_reads_the_export_into_tp_shards(two: list[dict[str, Any]]) -> None:
    assert W.max_diff(two[0]["gpt2 from_pretrained"], two[0]["gpt2 zero3"].state) == 0.0
