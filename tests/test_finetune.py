"""Fine-tuning with a frozen model beside the trained one (DPO's reference, a teacher), at 2 CPU
processes against one plain process.

A model with no trainable parameter is prepared for inference only, alone or in the same call as
the policy: sharded under zero3 (about half its elements on each of 2 ranks), a replica under
ddp/zero2, never wrapped for training, with no gradient and no optimizer state, on the torch
backend and on DeepSpeed's. Tolerances are the equivalence tests' (losses 1e-5, weights 2e-5);
the reference must come out bit-identical to its initial weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted, planted_here
from spawn import spawn
from torch import nn
from torch.nn import functional as F

BETA = 0.5  # DPO's temperature
STEPS, BATCH, WORLD = 3, 2, 2  # optimizer steps, pairs per process per step, processes
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# (backend, strategy, how the reference is prepared)
#   alone:    engine.prepare(ref) on its own, before the policy
#   together: engine.prepare(policy, ref, optimizer)
#   eval:     Accelerator.prepare_model(ref, evaluation_mode=True), its parameters NOT frozen
CASES: list[tuple[str, str, str]] = [
    ("torch", "ddp", "alone"),
    ("torch", "zero2", "alone"),
    ("torch", "zero2", "together"),
    ("torch", "zero3", "alone"),
    ("torch", "zero3", "together"),
    ("torch", "zero2", "eval"),
]
DS_CASES: list[tuple[str, str, str]] = [
    ("deepspeed", "zero3", "alone"),
    ("deepspeed", "zero3", "together"),
    ("deepspeed", "zero2", "together"),
]


def _models() -> tuple[nn.Module, nn.Module]:
    """A tiny GPT-2 policy and a reference that differs from it (so its log-probs matter)."""
    policy, ref = W.build("gpt2"), W.build("gpt2")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy, ref


def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected), each (STEPS, WORLD * BATCH, SEQ): step k's global batch."""
    data = W.Tokens(2 * STEPS * WORLD * BATCH, seed=11).data.view(STEPS, WORLD * BATCH, 2, W.SEQ)
    return data[:, :, 0], data[:, :, 1]


def _logps(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed next-token log-probability, (B,)."""
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy: nn.Module, ref: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """DPO: -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), the mean over the pairs.

    Chosen and rejected go through each model in one forward, as TRL does (on DeepSpeed ZeRO-3,
    two forwards of the trained model before one backward fail inside DeepSpeed's step)."""
    ids, n = torch.cat([chosen, rejected]), len(chosen)
    with torch.no_grad():
        ref_logps = _logps(ref, ids)
    logps = _logps(policy, ids)
    margin = (logps[:n] - ref_logps[:n]) - (logps[n:] - ref_logps[n:])
    return -F.logsigmoid(BETA * margin).mean()


@dataclass(frozen=True, slots=True)
class PlainDPO:
    """One plain process: losses, the trained policy's and the frozen reference's weights."""

    losses: list[float]
    policy: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class DPO:
    """A DPO run on the engine: losses (averaged over processes), the gathered policy and
    reference; the reference's weights before prepare, the class it came back as, the share of
    its elements this process holds, how many of its parameters got gradients and how many the
    optimizers hold; its weights after save_state + load_state ({}: not resumed)."""

    losses: list[float]
    policy: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor]
    ref_init: dict[str, torch.Tensor]
    ref_type: str
    ref_share: float
    ref_grads: int
    ref_in_optimizer: int
    resumed_ref: dict[str, torch.Tensor]


def _reference() -> PlainDPO:
    """One plain process on the whole global batch of every step."""
    policy, ref = _models()
    ref.requires_grad_(False)
    opt = W.make_optimizer(policy)
    chosen, rejected = _pairs()
    losses = []
    for k in range(STEPS):
        loss = dpo_loss(policy, ref, chosen[k], rejected[k])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return PlainDPO(losses, W.clone_state(policy), W.clone_state(ref))


def _local_numel(t: torch.Tensor) -> int:
    local = getattr(t, "to_local", None)  # an FSDP2 shard (DTensor)
    return int(local().numel()) if local is not None else t.numel()


def _dpo(backend: str, strategy: str, mode: str, folder: str) -> DPO:
    import shardwise

    policy, ref = _models()
    ref_init = W.clone_state(ref)
    full_numel = sum(p.numel() for p in ref.parameters())
    opt = W.make_optimizer(policy)
    kw = {"backend": backend, "strategy": strategy, "cpu": True}
    if mode == "eval":
        engine: Any = shardwise.Accelerator(**kw)
        policy, opt = engine.prepare(policy, opt)
        ref = engine.prepare_model(ref, evaluation_mode=True)
    else:
        engine = shardwise.Engine(seed=W.SEED, **kw)
        ref.requires_grad_(False)
        if mode == "alone":
            ref = engine.prepare(ref)
            policy, opt = engine.prepare(policy, opt)
        else:
            policy, ref, opt = engine.prepare(policy, ref, opt)
    chosen, rejected = _pairs()
    mine = slice(engine.process_index * BATCH, (engine.process_index + 1) * BATCH)
    losses = []
    for k in range(STEPS):
        loss = dpo_loss(policy, ref, chosen[k, mine], rejected[k, mine])
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    resumed = {}
    if mode == "together":  # a checkpoint holds the reference too, and loads back into it
        engine.save_state(f"{folder}/{backend}-{strategy}")
        engine.load_state(f"{folder}/{backend}-{strategy}")
        resumed = engine.get_state_dict(ref)
    ref_ids = {id(p) for p in ref.parameters()}
    held = [p for o in engine.session.optimizers for p in [*o.runner.params(), *o.optimizer.state]
            if id(p) in ref_ids]
    return DPO(
        losses=losses,
        policy=engine.get_state_dict(policy),
        ref=engine.get_state_dict(ref),
        ref_init=ref_init,
        ref_type=type(ref).__name__,
        ref_share=sum(_local_numel(p) for p in engine.unwrap_model(ref).parameters()) / full_numel,
        ref_grads=sum(p.grad is not None for p in ref.parameters()),
        ref_in_optimizer=len(held),
        resumed_ref=resumed,
    )


def _all_runs(cases: list[tuple[str, str, str]], folder: str) -> dict[tuple[str, str, str], DPO]:
    return {case: _dpo(*case, folder) for case in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], DPO]:
    # one pair of processes for every case (DeepSpeed's start-up is paid once)
    folder = str(tmp_path_factory.mktemp("dpo"))
    return spawn(_all_runs, WORLD, CASES + (DS_CASES if HAS_DEEPSPEED else []), folder, timeout=1200)[0]


@pytest.fixture(scope="module")
def ref() -> PlainDPO:
    return _reference()


def _check(run: DPO, ref: PlainDPO, case: tuple[str, str, str]) -> None:
    _, strategy, mode = case
    assert W.close(run.losses, ref.losses) < 1e-5, (run.losses, ref.losses)
    assert W.max_diff(run.policy, ref.policy) < 2e-5
    assert W.max_diff(run.policy, W.clone_state(_models()[0])) > 1e-4  # the policy did train
    assert all(torch.equal(run.ref[k], run.ref_init[k]) for k in run.ref_init)  # reference unchanged
    assert run.ref.keys() == run.ref_init.keys()
    assert run.ref_grads == 0 and run.ref_in_optimizer == 0  # no gradients, no optimizer state
    if mode == "together":  # save_state + load_state with the reference prepared
        assert run.resumed_ref.keys() == run.ref_init.keys()
        assert all(torch.equal(run.resumed_ref[k], run.ref_init[k]) for k in run.ref_init)
    assert run.ref_type in ("GPT2LMHeadModel", "FSDPGPT2LMHeadModel")  # no DDP or DeepSpeed wrapper
    if strategy == "zero3":  # sharded: each of 2 ranks holds about half of the elements
        assert 0.45 < run.ref_share < 0.55, run.ref_share
    else:  # a replica
        assert run.ref_share == 1.0, \
            f"{case}: the reference holds {run.ref_share} of its elements on each process, not a whole " \
            "replica"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_dpo_with_a_frozen_reference_equals_one_process(
    runs: dict, ref: dict, case: tuple[str, str, str]
) -> None:
    _check(runs[case], ref, case)


def test_a_reference_prepared_for_evaluation_but_sharded_is_caught(tmp_path: Any, ref: PlainDPO) -> None:
    case = ("torch", "zero2", "eval")  # (as the real test's)
    run = spawn(planted(_all_runs, "evaluation_model_sharded"), WORLD, [case], str(tmp_path))[0][case]
    caught(_check, run, ref, case,
           must=r"^\('torch', 'zero2', 'eval'\): the reference holds 0\.5 of its elements on each process")


@pytest.mark.skipif(not HAS_DEEPSPEED,
                    reason="deepspeed not installed (pip install 'shardwise[deepspeed]'); CI installs it")
@pytest.mark.parametrize("case", DS_CASES, ids=lambda c: "-".join(c))
def test_dpo_on_deepspeed_with_a_frozen_reference_equals_one_process(
    runs: dict, ref: dict, case: tuple[str, str, str]
) -> None:
    _check(runs[case], ref, case)


def test_frozen_and_parameterless_models_prepare_on_one_process() -> None:
    """Preparing a frozen or parameterless model works; an optimizer over a frozen model, or over
    one prepared with evaluation_mode=True, is refused in one line before anything is prepared."""
    check_frozen_refusals()


def test_an_optimizer_over_a_frozen_model_accepted_is_caught() -> None:
    with planted_here("frozen_optimizer_accepted"):
        caught(check_frozen_refusals, must=r"DID NOT RAISE .*ValueError")  # an optimizer over it accepted


def check_frozen_refusals() -> None:
    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    relu = engine.prepare(nn.ReLU())
    assert torch.equal(relu(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    frozen = W.build("tiny").requires_grad_(False)
    refusal = (r"^AdamW holds 23 parameter\(s\) of TinyLM, which has no trainable parameters "
               r"\(all frozen\) and is prepared for inference only: unfreeze what should train")
    with pytest.raises(ValueError, match=refusal) as frozen_err:
        engine.prepare(frozen, W.make_optimizer(frozen))
    assert "\n" not in str(frozen_err.value)
    assert type(frozen) is W.TinyLM  # refused before sharding
    acc = shardwise.Accelerator(cpu=True, strategy="ddp")
    teacher = acc.prepare_model(W.build("tiny"), evaluation_mode=True)
    assert type(teacher) is W.TinyLM  # no DDP wrapper
    with pytest.raises(ValueError, match=r"which is prepared with evaluation_mode=True .*: "
                                         r"prepare it without evaluation_mode") as eval_err:
        acc.prepare(torch.optim.SGD(teacher.parameters(), lr=0.1))
    assert "\n" not in str(eval_err.value)
