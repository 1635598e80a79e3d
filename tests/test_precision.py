"""bf16 and fp16 on 2 CPU processes, and the fp16 loss scaler's skip-on-overflow.

bf16/fp16 keep fp32 master weights, fp32 gradient reduction and fp32 optimizer state; only the
compute is low precision, so the loss curve follows the fp32 reference closely: we assert every
micro-batch loss within 2e-2 (bf16 has an 8-bit mantissa; the observed gap is ~5e-3) and
fp16 within 5e-3. bf16 matmuls are very slow on this CPU, hence the tiny sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch.utils.data import DataLoader

RUN = {"batch": 2, "accum": 2, "steps": 2}
CASES = [("bf16", "zero3"), ("bf16", "ddp"), ("fp16", "zero3"), ("fp16", "zero1")]


@dataclass(frozen=True, slots=True)
class Overflow:
    """An fp16 run whose step 1 overflowed on rank 0: its losses; the weights, loss scale and LRs
    around that step; whether it was skipped; how far step 2 then moved the weights (rank 0)."""

    losses: list[float]
    before: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]
    skipped: bool
    scale_before: float
    scale_after: float
    lr_before: list[float]
    lr_after: list[float]
    moved_after_skip: float | None


def _overflow_run(strategy: str) -> Overflow:
    """fp16 training where rank 0 alone gets an inf in one gradient at step 1."""
    import shardwise

    engine = shardwise.Engine(strategy=strategy, precision="fp16", cpu=True, seed=W.SEED)
    model = W.build("tiny")
    opt = W.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    loader = DataLoader(W.Tokens(2 * 2 * 3), batch_size=2, shuffle=True)
    model, opt, sched, loader = engine.prepare(model, opt, sched, loader)
    losses: list[float] = []
    moved_after_skip = None
    for i, ids in enumerate(loader):
        loss = W.lm_loss(model, ids)
        engine.backward(loss)
        losses.append(loss.item())
        if i == 1:
            before, scale_before = engine.get_state_dict(model), engine.loss_scale
            lr_before = sched.get_last_lr()
            if engine.process_index == 0:  # only one rank sees the overflow
                grad = next(model.parameters()).grad
                getattr(grad, "_local_tensor", grad).view(-1)[0] = float("inf")
        engine.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if i == 1:
            after, skipped = engine.get_state_dict(model), opt.step_was_skipped
            scale_after, lr_after = engine.loss_scale, sched.get_last_lr()
        if i == 2:
            final = engine.get_state_dict(model)  # a collective: every rank calls it
            moved_after_skip = W.max_diff(final, after) if engine.is_main_process else None
    return Overflow(losses, before, after, skipped, scale_before, scale_after, lr_before, lr_after,
                    moved_after_skip)


@dataclass(frozen=True, slots=True)
class Work:
    """One process's results: the training runs by (precision, strategy) (and "gpt2-bf16"), the
    overflow runs by strategy."""

    runs: dict[Any, W.Trained]
    overflow: dict[str, Overflow]


def _work() -> Work:
    runs: dict[Any, W.Trained] = {
        (p, s): W.train_engine("tiny", {"cpu": True, "strategy": s, "precision": p}, **RUN) for p, s in CASES
    }
    runs["gpt2-bf16"] = W.train_engine("gpt2", {"cpu": True, "strategy": "zero3", "precision": "bf16"}, **RUN)
    return Work(runs, {s: _overflow_run(s) for s in ("zero3", "ddp")})


@pytest.fixture(scope="module")
def results() -> list[Work]:
    return spawn(_work, 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_low_precision_follows_fp32(results: list, case: tuple[str, str]) -> None:
    check_follows(results[0].runs[case], case)


def check_follows(run: W.Trained, case: tuple[str, str]) -> None:
    """Close to fp32, and not fp32: the compute really ran in the low precision (an fp32 run
    lands within ~1e-7 of the reference; here bf16 1.8e-4 to 5.4e-4 away, fp16 3.3e-5 to 9.6e-5)."""
    ref = W.reference("tiny", world=2, **RUN)
    tol = 2e-2 if case[0] == "bf16" else 5e-3
    assert W.is_finite(run.losses)
    assert 1e-5 < W.close(run.losses, ref.losses) < tol, \
        f"{case}: losses {W.close(run.losses, ref.losses):.2e} from fp32's, not between 1e-5 and {tol}"
    assert W.max_diff(run.state, ref.state) < 1e-2  # fp32 masters: weights stay close (measured: 3.3e-3)
    assert all(v.dtype == torch.float32 for v in run.state.values())


def test_bf16_transformers_gpt2(results: list) -> None:
    run = results[0].runs["gpt2-bf16"]
    ref = W.reference("gpt2", world=2, **RUN)
    assert W.close(run.losses, ref.losses) < 2e-2


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_fp16_skips_overflow_step_on_every_rank(results: list, strategy: str) -> None:
    check_overflow(results, strategy)


def check_overflow(results: list, strategy: str) -> None:
    for rank, res in enumerate(results):
        r = res.overflow[strategy]
        assert r.skipped, f"rank {rank} did not skip"
        assert r.scale_after == r.scale_before * 0.5
        assert r.lr_after == r.lr_before  # the schedule waits too
        assert W.is_finite(r.losses)
    main = results[0].overflow[strategy]
    assert W.max_diff(main.after, main.before) == 0.0  # the skipped step left weights alone
    assert main.moved_after_skip > 0  # and the next step trained again


def _planted_overflow() -> Work:
    return Work({}, {"zero3": _overflow_run("zero3")})  # (as the real test's zero3 case)


def test_an_overflow_verdict_kept_local_is_caught() -> None:
    caught(check_overflow, spawn(planted(_planted_overflow, "overflow_verdict_local"), 2), "zero3",
           must=r"^rank 1 did not skip")


def _planted_bf16() -> W.Trained:
    return W.train_engine("tiny", {"cpu": True, "strategy": "zero3", "precision": "bf16"}, **RUN)


def test_a_precision_left_at_fp32_is_caught() -> None:
    caught(check_follows, spawn(planted(_planted_bf16, "precision_ignored"), 2)[0], ("bf16", "zero3"),
           must=r"^\('bf16', 'zero3'\): losses ([\d.]+e-(0[6-9]|[1-9]\d)|0\.00e\+00) from fp32's")  # fp32
