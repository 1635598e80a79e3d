"""Token-weighted loss: `engine.backward(loss_sum, num_items=n)` at 2 processes x 2 micro-batches
trains what one plain process trains on the mean over every token of the whole global batch.

Padded variable-length samples (1 to 7 target tokens out of 7), so micro-batches carry very
different token counts. The plain process takes each optimizer step's 8 samples in one forward,
`sum(token losses) / N`, clips at 0.5 and steps AdamW. The sharded runs count tokens locally per
micro-batch and agree on N once per optimizer step (`shardwise.engine.items`). Tolerances as in
`test_equivalence.py`: losses 1e-5, clip norms 1e-5 relative, weights 2e-5. The usual
per-micro-batch mean is measured against the same reference (its drift is in docs/finetuning.md).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch import nn
from torch.utils.data import DataLoader, Dataset

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
WORLD, BATCH, ACCUM, STEPS, CLIP = 2, 2, 2, 3, 0.5
CONFIGS: list[dict[str, Any]] = [
    {"strategy": "ddp"},
    {"strategy": "zero1"},
    {"strategy": "zero2"},
    {"strategy": "zero3"},
    {"strategy": "zero2", "offload": "optimizer"},
    {"strategy": "zero3", "max_grad_norm": CLIP},  # the config's bound, no clip call in the loop
]
DS_CONFIGS: list[dict[str, Any]] = [{"backend": "deepspeed", "strategy": s} for s in ("zero2", "zero3")]
CASES = [("tiny", c) for c in CONFIGS] + [("gpt2", {"strategy": "zero3"})]
CASES += [("tiny", c) for c in DS_CONFIGS] if HAS_DEEPSPEED else []


def _key(case: tuple[str, dict[str, Any]]) -> str:
    name, cfg = case
    return name + ":" + "+".join(f"{k}={v}" if k == "max_grad_norm" else str(v) for k, v in cfg.items())


class Padded(Dataset[dict[str, torch.Tensor]]):
    """Token rows of random length 2..SEQ, padded with 0; labels -100 on the padding."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(1, W.VOCAB, (n, W.SEQ), generator=g)
        lengths = torch.randint(2, W.SEQ + 1, (n,), generator=g)
        pad = torch.arange(W.SEQ)[None, :] >= lengths[:, None]
        self.labels = self.ids.masked_fill(pad, -100)
        self.ids = self.ids.masked_fill(pad, 0)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss over the real tokens, and how many there are."""
    out = model(input_ids=batch["input_ids"])
    logits = out.logits if hasattr(out, "logits") else out
    targets = batch["labels"][:, 1:]
    total = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, W.VOCAB).float(), targets.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def reference(name: str) -> W.Trained:
    """One plain process: each optimizer step's whole global batch in one forward, token mean."""
    model = W.build(name)
    opt = W.make_optimizer(model)
    data = Padded(WORLD * BATCH * ACCUM * STEPS)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(W.SEED)).tolist()
    per_step = WORLD * BATCH * ACCUM
    losses, norms = [], []
    for k in range(STEPS):
        batch = data[order[k * per_step : (k + 1) * per_step]]
        total, n = loss_sum(model, batch)
        loss = total / n
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return W.Trained(losses, norms, state=W.clone_state(model))


def train(name: str, engine_kw: dict[str, Any], *, weighted: bool = True) -> W.Trained:
    """The loop at 2 processes: `backward(loss_sum, num_items=n)` (or, `weighted=False`, the
    usual per-micro-batch mean); each step's token mean over both processes is recorded."""
    import shardwise

    engine = shardwise.Engine(grad_accum_steps=ACCUM, seed=W.SEED, cpu=True, **engine_kw)
    model = W.build(name)
    opt = W.make_optimizer(model)
    loader = DataLoader(Padded(WORLD * BATCH * ACCUM * STEPS), batch_size=BATCH, shuffle=True)
    model, opt, loader = engine.prepare(model, opt, loader)
    losses, norms, window = [], [], torch.zeros(2)
    for batch in loader:
        with engine.accumulate(model):
            total, n = loss_sum(model, batch)
            if weighted:
                engine.backward(total, num_items=n)
            else:
                engine.backward(total / n)
            window += engine.reduce(torch.stack([total.detach(), n.float()]), "sum")  # for the record only
            if engine.sync_gradients:
                losses.append(float(window[0] / window[1]))
                window.zero_()
                if "max_grad_norm" not in engine_kw:
                    norms.append(float(engine.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    return W.Trained(losses, norms, state=engine.get_state_dict(model))


def careless() -> list[str]:
    """A window that mixes num_items with a mean loss, and a negative count: one line each,
    raised before the backward runs (the gradients stay as they were)."""
    import shardwise

    engine = shardwise.Engine(grad_accum_steps=ACCUM, seed=W.SEED, cpu=True, strategy="ddp")
    model = W.build("tiny")
    model, _ = engine.prepare(model, W.make_optimizer(model))
    batch = Padded(4)[2 * engine.process_index : 2 * engine.process_index + 2]
    lines = []
    with engine.accumulate(model):
        total, n = loss_sum(model, batch)
        engine.backward(total, num_items=n)
    before = [p.grad.clone() for p in model.parameters()]
    for call in ({}, {"num_items": -1}):
        with engine.accumulate(model):
            total, n = loss_sum(model, batch)
            try:
                engine.backward(total / n if not call else total, **call)
            except ValueError as err:
                lines.append(str(err))
            assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    return lines


def _everything() -> dict[str, Any]:
    """W.Trained by case (and "mean ddp", "mean zero3"); "careless": careless()'s lines."""
    out: dict[str, Any] = {_key(case): train(*case) for case in CASES}
    out["mean ddp"] = train("tiny", {"strategy": "ddp"}, weighted=False)
    out["mean zero3"] = train("tiny", {"strategy": "zero3"}, weighted=False)
    out["careless"] = careless()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return spawn(_everything, WORLD)[0]  # rank 0 holds the full state dicts


@pytest.fixture(scope="module")
def refs() -> dict[str, W.Trained]:
    return {name: reference(name) for name in ("tiny", "gpt2")}


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_token_weighted_loss_matches_one_process(runs: dict, refs: dict,
                                                 case: tuple[str, dict[str, Any]]) -> None:
    check_weighted(runs[_key(case)], refs[case[0]], case)


def check_weighted(run: W.Trained, ref: W.Trained, case: tuple[str, dict[str, Any]]) -> None:
    assert len(run.losses) == STEPS
    assert W.close(run.losses, ref.losses) < 1e-5, \
        f"{_key(case)}: losses {W.close(run.losses, ref.losses):.2e} from one process's"
    if run.norms:  # the script clipped (else the config's max_grad_norm did)
        assert min(ref.norms) > CLIP  # every step really clipped, after the rescale
        assert W.close(run.norms, ref.norms) < 1e-5 * max(ref.norms)
    print(f"\n{_key(case)}: losses {W.close(run.losses, ref.losses):.1e}, "
          f"weights {W.max_diff(run.state, ref.state):.1e}")
    assert W.max_diff(run.state, ref.state) < 2e-5
    assert W.max_diff(run.state, W.build(case[0]).state_dict()) > 1e-3  # the weights moved


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_per_micro_batch_mean_drifts(runs: dict, refs: dict, strategy: str) -> None:
    """The usual per-micro-batch mean trains another model than the token mean (so the test above
    can fail): its distance is printed for docs/finetuning.md (`pytest -s`)."""
    run, ref = runs[f"mean {strategy}"], refs["tiny"]
    loss_drift = W.close(run.losses[1:], ref.losses[1:])  # step 0's loss is taken before any step
    weight_drift = W.max_diff(run.state, ref.state)
    print(f"\nper-micro-batch mean vs token mean ({strategy}, {STEPS} steps): "
          f"step losses {loss_drift:.2e}, weights {weight_drift:.2e}")
    assert weight_drift > 1e-3 and loss_drift > 1e-4


def test_careless_num_items(runs: dict) -> None:
    mixed, negative = runs["careless"]
    assert "pass num_items= to every backward of an accumulation window or to none" in mixed
    assert "backward(num_items=-1)" in negative and "\n" not in mixed + negative


def _planted_weighted() -> W.Trained:
    return train("tiny", {"strategy": "zero3"})  # (as the real test's zero3 case)


def test_a_count_of_items_left_local_is_caught(refs: dict) -> None:
    run = spawn(planted(_planted_weighted, "items_count_local"), WORLD)[0]
    caught(check_weighted, run, refs["tiny"], ("tiny", {"strategy": "zero3"}),
           must=r"^tiny:zero3: losses [\d.]+e[-+]\d+ from one process's")
