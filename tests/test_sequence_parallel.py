"""Sequence parallelism (`sequence_parallel: true` with tensor parallelism) against one plain
process (fp32).

Under sequence parallelism the activations between the split layers are split over the sequence
across the tp ranks (each holds half the tokens of a norm, a residual, a block boundary), the
sublayers all-gather their input and the rowwise layers reduce-scatter their output:
  2 processes   tp 2 with ddp, zero2 and zero3 on the tiny transformers Llama (its own plan), zero3
                with full activation checkpointing (the gathers recomputed in backward), and GPT-2
                on its built-in plan (the fused q/k/v Conv1D, a rowwise bias added to half the
                tokens) with zero3: losses and clipped gradient norms within 1e-5 of one process on
                the same batches, final weights within 1e-5; each rank holds its plan's share (the
                norms whole); sequence parallelism is on: the bytes autograd saves in one forward
                (every saved storage once) are fewer than the same case's without it by exactly
                the activations it halves (`_sp_saving`, derived from batch x sequence x hidden);
                the zero3
                checkpoint loads under zero3 without tp bit-identical and its export loads in
                transformers' `from_pretrained` bit-identical, and into sequence-parallel shards
                by `engine.from_pretrained`; `init_empty()` gives a normal build's weights bit for
                bit; a sequence tp does not divide is refused in one line;
  4 processes   dp 2 x tp 2 with zero2 and zero3 (Llama) and zero3 (GPT-2): the same checks
                against one process with the global batch, each rank holding half its tp share.
Tolerances: as tensor parallelism's (the sums of a matmul split in two, then added), a few ulps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from test_tensor_parallel import BATCH, PLANNED, STEPS, Moved, tp_share
from torch.utils.data import DataLoader

from shardwise import SavedActivations

# case -> (model, strategy, activation checkpointing)
TWO = {"ddp": ("llama", "ddp", "none"), "zero2": ("llama", "zero2", "none"),
       "zero3": ("llama", "zero3", "none"), "zero3 AC": ("llama", "zero3", "full"),
       "gpt2 zero3": ("gpt2", "zero3", "none")}
FOUR = {"zero2": ("llama", "zero2", "none"), "zero3": ("llama", "zero3", "none"),
        "gpt2 zero3": ("gpt2", "zero3", "none")}


@dataclass(frozen=True, slots=True)
class Run:
    """One sequence-parallel run: losses (averaged over processes), clipped norms, the final
    full weights (gathered on every rank), the parameters this rank holds, the bytes autograd
    saved in the first forward, the batches each rank took, and the bytes autograd saves in one
    forward of the same case without sequence parallelism (`_saved_without_sp`)."""

    losses: list[float]
    norms: list[float]
    state: dict[str, torch.Tensor]
    local: int
    saved: int
    batches: int
    no_sp: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _train(engine: Any, dp: int, name: str) -> Run:
    model = W.build(name)
    opt = W.make_optimizer(model)
    loader = DataLoader(W.Tokens(dp * BATCH * STEPS), batch_size=BATCH, shuffle=True)
    model, opt, loader = engine.prepare(model, opt, loader)
    losses, norms, saved = [], [], 0
    for i, ids in enumerate(loader):
        with SavedActivations() as seen:  # (each storage once, a DTensor's local one)
            loss = W.lm_loss(model, ids)
        if i == 0:
            saved = seen.total
        engine.backward(loss)
        losses.append(engine.reduce(loss.detach(), "mean").item())
        norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return Run(losses, norms, engine.get_state_dict(model), local, saved, len(loader), extra={"model": model})


def _saved_without_sp(name: str, strategy: str, ac: str) -> int:
    """The bytes autograd saves in one forward of `name` under `strategy` (and `ac`) with tp 2 and
    no sequence parallelism: the baseline of `_sp_saving` (a forward and backward, no step)."""
    import shardwise

    engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, tensor_parallel_size=2,
                              activation_checkpointing=ac)
    model = engine.prepare(W.build(name))
    with SavedActivations() as seen:
        loss = W.lm_loss(model, W.Tokens(BATCH).data)
    engine.backward(loss)
    engine.free_memory()
    return seen.total


def _case(case: str, spec: tuple[str, str, str], dp: int, folder: str | None = None) -> Run:
    """One sequence-parallel case (model, strategy, activation checkpointing) trained, with its
    baseline without sequence parallelism; `folder`: its checkpoint directory's parent."""
    import shardwise

    name, strategy, ac = spec
    no_sp = _saved_without_sp(name, strategy, ac)  # (its engine released before this one starts)
    engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, tensor_parallel_size=2,
                              sequence_parallel=True, activation_checkpointing=ac,
                              **({"checkpoint_dir": f"{folder}/{case.replace(' ', '_')}"} if folder else {}))
    run = _train(engine, dp=dp, name=name)
    return replace(run, no_sp=no_sp, extra={**run.extra, "engine": engine})


def _cases(cases: dict[str, tuple[str, str, str]], dp: int) -> dict[str, Run]:
    """Each of `cases` trained at `dp` data-parallel ranks x tp 2 (nothing saved)."""
    out: dict[str, Run] = {}
    for case, spec in cases.items():
        run = _case(case, spec, dp)
        run.extra["engine"].free_memory()
        out[case] = replace(run, extra={})
    return out


def _two(folder: str) -> dict[str, Any]:
    import shardwise

    out: dict[str, Any] = {}
    for case, spec in TWO.items():
        run = _case(case, spec, dp=1, folder=folder)
        engine = run.extra["engine"]
        if case == "zero3":
            engine.save_state()
            engine.save_model(run.extra["model"], f"{folder}/export")
            try:  # a sequence of 7 tokens: tp 2 does not divide it
                W.lm_loss(run.extra["model"], torch.zeros(BATCH, 7, dtype=torch.long))
            except Exception as err:  # noqa: BLE001 - the message is the result
                out["odd sequence"] = f"{type(err).__name__}: {err}"
        out[case] = replace(run, extra={})
        engine.free_memory()
    # init_empty() and from_pretrained under sequence parallelism (the norms replicated DTensors)
    from transformers import LlamaForCausalLM

    for name in ("llama", "gpt2"):
        engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, tensor_parallel_size=2,
                                  sequence_parallel=True)
        with engine.init_empty():
            model = W.build(name)
        out[f"empty {name}"] = engine.get_state_dict(engine.prepare(model))
        engine.free_memory()
    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, tensor_parallel_size=2,
                              sequence_parallel=True)
    out["from_pretrained"] = engine.get_state_dict(engine.prepare(
        engine.from_pretrained(LlamaForCausalLM, f"{folder}/export")))
    engine.free_memory()
    # the sequence-parallel checkpoint under zero3 at 2 without tp
    plain = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, checkpoint_dir=f"{folder}/zero3")
    model = W.build("llama")
    loader = DataLoader(W.Tokens(2 * BATCH * STEPS), batch_size=BATCH, shuffle=True)
    model, _opt, _loader = plain.prepare(model, W.make_optimizer(model), loader)
    out["into_zero3"] = Moved(plain.load_state(), plain.get_state_dict(model))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sp")


@pytest.fixture(scope="module")
def two(folder: Path) -> list[dict[str, Any]]:
    return spawn(_two, 2, str(folder))


@pytest.fixture(scope="module")
def four() -> list[dict[str, Run]]:
    return spawn(_cases, 4, FOUR, 2)


def _reference(dp: int, name: str) -> Any:
    return W.reference(name, world=dp, batch=BATCH, accum=1, steps=STEPS, clip=1.0)


def _share(name: str) -> int:
    """Parameters one tp rank holds: the planned weights halved, the rest (norms) whole."""
    if name == "gpt2":
        return tp_share("gpt2", lambda n: n.endswith(("c_attn.weight", "c_fc.weight", "c_fc.bias",
                                                       "c_proj.weight")))
    return tp_share("llama", lambda n: n.split(".")[-2] in PLANNED)


def _sp_saving(name: str, ac: str) -> int:
    """The bytes sequence parallelism takes off what autograd saves in one forward on a rank,
    derived: at tp 2 these activations are held for B x S / 2 tokens instead of B x S (batch B =
    BATCH per data-parallel rank, sequence S, hidden H, fp32: 4 bytes), everything else the same
    (the sublayers' gathered input is as whole as the norm output it replaces):
      no checkpointing  each block's two norms: Llama's RMSNorm saves its input and its normalized
                        output (B x S x H each) and the reciprocal root mean square (B x S);
                        GPT-2's LayerNorm its input (B x S x H), mean and reciprocal std (B x S each);
      full checkpointing  each block's input (B x S x H), kept for the recompute, and nothing inside.
    """
    config = W.build(name).config
    tokens, hidden = BATCH * W.SEQ, config.hidden_size
    if ac == "full":
        per_block = tokens * hidden
    elif name == "llama":
        per_block = 2 * (2 * tokens * hidden + tokens)
    else:
        per_block = 2 * (tokens * hidden + 2 * tokens)
    return config.num_hidden_layers * per_block * 4 // 2


def _check_case(ranks: list[dict[str, Any]], case: str, spec: tuple[str, str, str], dp: int) -> None:
    """One sequence-parallel case against one plain process on the same global batches: losses
    and clipped norms within 1e-5, final weights within 1e-5; on every rank its plan's share of
    the parameters (halved again over dp 2 by zero2/zero3: every dim 0 divides by 4 here), and
    the bytes autograd saves in one forward fewer than without sequence parallelism by exactly
    `_sp_saving` (the activations it splits over the sequence)."""
    name, strategy, ac = spec
    ref = _reference(dp, name)
    saving = _sp_saving(name, ac)
    share = _share(name) // (dp if strategy in ("zero2", "zero3") else 1)
    assert dp == 1 or all(p.shape[0] % 4 == 0 for p in W.build(name).parameters())
    for r, rank in enumerate(ranks):
        run: Run = rank[case]
        assert run.batches == STEPS
        assert W.close(run.losses, ref.losses) < 1e-5 and W.close(run.norms, ref.norms) < 1e-5
        assert run.local == share, (case, r, run.local, share)
        assert run.no_sp - run.saved == saving, (
            f"{case}, rank {r}: saved {run.saved} bytes with sequence parallelism, {run.no_sp} without: "
            f"{run.no_sp - run.saved} fewer, derived {saving}")
    assert W.max_diff(ranks[0][case].state, ref.state) < 1e-5


@pytest.mark.parametrize("case", list(TWO))
def test_sequence_parallel_tp2_matches_one_process(two: list[dict[str, Any]], case: str) -> None:
    _check_case(two, case, TWO[case], dp=1)


def test_sequence_parallel_switched_off_is_caught() -> None:
    """Planted `sequence_parallel_off`: `sequence_parallel=True` ignored (plain tp 2, the same
    losses and shares); the case's check must fail on the bytes saved."""
    ranks = spawn(planted(_cases, "sequence_parallel_off"), 2, {"zero3": TWO["zero3"]}, 1)
    caught(_check_case, ranks, "zero3", TWO["zero3"], 1,
           must=r"^zero3, rank 0: saved (\d+) bytes with sequence parallelism, \1 without: 0 fewer, "
                r"derived \d+")


def test_a_sequence_parallel_checkpoint_and_export_load_without_tp(two: list[dict[str, Any]],
                                                                   folder: Path) -> None:
    from transformers import LlamaForCausalLM

    trained = two[0]["zero3"].state
    for rank in two:
        assert rank["into_zero3"].step == STEPS
    assert W.max_diff(two[0]["into_zero3"].state, trained) == 0.0
    plain = LlamaForCausalLM.from_pretrained(folder / "export")
    assert W.max_diff(dict(plain.state_dict()), trained) == 0.0


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_init_empty_under_sequence_parallelism_gives_a_normal_builds_weights(two: list[dict[str, Any]],
                                                                            name: str) -> None:
    assert W.max_diff(two[0][f"empty {name}"], dict(W.build(name).state_dict())) == 0.0


def test_from_pretrained_reads_an_export_under_sequence_parallelism(two: list[dict[str, Any]]) -> None:
    assert W.max_diff(two[0]["from_pretrained"], two[0]["zero3"].state) == 0.0


def test_a_sequence_tp_does_not_divide_is_refused_in_one_line(two: list[dict[str, Any]]) -> None:
    for rank in two:
        message = W.one_line(rank["odd sequence"])
        assert message.startswith("ConfigError: sequence_parallel: the sequence length 7 does not divide")


@pytest.mark.parametrize("case", list(FOUR))
def test_sequence_parallel_dp2_x_tp2_matches_one_process(four: list[dict[str, Run]], case: str) -> None:
    _check_case(four, case, FOUR[case], dp=2)
