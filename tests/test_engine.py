"""Engine verbs on 2 CPU processes: several models, optimizer order, metrics, clipping, accumulation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch.utils.data import DataLoader, Dataset, IterableDataset

RUN = {"batch": 2, "accum": 2, "steps": 3}


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class IndexedStream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.tensor(i) for i in range(self.n))


def _two_models(engine: Any) -> dict[str, W.Trained]:
    """Two models, one optimizer made before prepare, one after, in one run: each model's losses
    (averaged over processes) and final weights, by name."""
    a, b = W.build("tiny"), W.build("gpt2")
    opt_a = W.make_optimizer(a)
    loader = DataLoader(W.Tokens(engine.num_processes * 2 * 2 * 3), batch_size=2, shuffle=True)
    a, opt_a, b, loader = engine.prepare(a, opt_a, b, loader)
    opt_b = engine.prepare(W.make_optimizer(b))  # built from the already sharded parameters
    losses: dict[str, list[float]] = {"tiny": [], "gpt2": []}
    norms: dict[str, list[float]] = {"tiny": [], "gpt2": []}
    for ids in loader:
        with engine.accumulate(a, b):
            la, lb = W.lm_loss(a, ids), W.lm_loss(b, ids)
            engine.backward(la + lb)
            losses["tiny"].append(engine.reduce(la.detach(), "mean").item())
            losses["gpt2"].append(engine.reduce(lb.detach(), "mean").item())
            if engine.sync_gradients:
                norms["tiny"].append(float(engine.clip_grad_norm_(a.parameters(), 1.0)))
                norms["gpt2"].append(float(engine.clip_grad_norm_(b.parameters(), 1.0)))
            for opt in (opt_a, opt_b):
                opt.step()
                opt.zero_grad()
    return {"tiny": W.Trained(losses["tiny"], norms["tiny"], state=engine.get_state_dict(a)),
            "gpt2": W.Trained(losses["gpt2"], norms["gpt2"], state=engine.get_state_dict(b))}


def _metrics(engine: Any) -> dict[str, Any]:
    out = {}
    for label, ds, shuffle in [
        ("map", Indexed(13), False),
        ("map-shuffled", Indexed(13), True),
        ("iterable", IndexedStream(13), False),
    ]:
        loader = engine.prepare(DataLoader(ds, batch_size=2, shuffle=shuffle))
        seen = [engine.gather_for_metrics(batch) for batch in loader]
        out[label] = {
            "all": torch.cat(seen).tolist(),
            "plain_gather": sum(len(engine.gather(b)) for b in loader),
            "batches": len(loader) if label != "iterable" else None,
        }
    return out


def _subset_norm(engine: Any) -> dict[str, float]:
    """Norm of a subset of sharded gradients equals the norm over the same full gradients."""
    model = W.build("gpt2")
    ref = W.build("gpt2")
    model = engine.prepare(model)
    ids = W.Tokens(8).data[engine.process_index * 4 : (engine.process_index + 1) * 4]
    engine.backward(W.lm_loss(model, ids))
    subset = [p for n, p in model.named_parameters() if "h.1." in n]
    norm = float(engine.clip_grad_norm_(subset, 1e9))
    W.lm_loss(ref, W.Tokens(8).data).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_([p for n, p in ref.named_parameters() if "h.1." in n], 1e9)
    return {"norm": norm, "ref": float(ref_norm)}


def _accumulation(engine: Any) -> dict[str, Any]:
    """Off the boundary: no step, no zero_grad, no scheduler step, clip returns None."""
    model = W.build("tiny")
    opt = W.make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = engine.prepare(model, opt, sched)
    ids = W.Tokens(4).data[:2]
    before = engine.get_state_dict(model)
    with engine.accumulate(model):
        engine.backward(W.lm_loss(model, ids))
        micro = {"sync": engine.sync_gradients, "clip": engine.clip_grad_norm_(model.parameters(), 1.0)}
        opt.step()
        sched.step()
        opt.zero_grad()
    micro["unchanged"] = engine.get_state_dict(model)
    micro["lr"] = sched.get_last_lr()
    with engine.accumulate(model):
        engine.backward(W.lm_loss(model, ids))
        boundary = {"sync": engine.sync_gradients, "clip": engine.clip_grad_norm_(model.parameters(), 1.0)}
        opt.step()
        sched.step()
        opt.zero_grad()
    boundary["changed"] = engine.get_state_dict(model)
    boundary["lr"] = sched.get_last_lr()
    return {"before": before, "micro": micro, "boundary": boundary}


def _work() -> dict[str, Any]:
    import shardwise

    out: dict[str, Any] = {}
    out["two_models"] = _two_models(shardwise.Engine(strategy="zero3", cpu=True, grad_accum_steps=2,
                                                     seed=W.SEED))
    for strategy in ("zero3", "ddp"):
        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED)
        out[f"metrics-{strategy}"] = _metrics(engine)
    out["subset_norm"] = _subset_norm(shardwise.Engine(strategy="zero3", cpu=True))
    out["accumulation"] = {
        s: _accumulation(shardwise.Engine(strategy=s, cpu=True, grad_accum_steps=2))
        for s in ("zero2", "zero1")
    }
    out["gather_mismatch"] = _gather_mismatch(shardwise.Engine(strategy="ddp", cpu=True))
    return out


def _gather_mismatch(engine: Any) -> dict[str, Any]:
    """Shapes and dtypes that differ across processes are refused in one line (both processes),
    lengths that differ are gathered, and max/min reduce."""
    from shardwise.checkpoint.sharded import CheckpointError

    out: dict[str, Any] = {}
    rank = engine.process_index
    for case, t in (("trailing shape", torch.zeros(2, 3 + rank)),
                    ("dtype", torch.zeros(2, dtype=[torch.float32, torch.int64][rank]))):
        try:
            engine.gather(t)
            out[case] = None
        except (ValueError, CheckpointError) as err:
            out[case] = str(err)
    out["lengths"] = engine.gather(torch.full((1 + rank, 2), float(rank))).tolist()
    out["max"] = engine.reduce(torch.tensor([float(rank), -float(rank)]), "max").tolist()
    out["min"] = engine.reduce(torch.tensor([float(rank), -float(rank)]), "min").tolist()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_work, 2)


def test_two_models_two_optimizers(results: list) -> None:
    check_two_models(results[0]["two_models"])


def check_two_models(run: dict[str, W.Trained]) -> None:
    for name in ("tiny", "gpt2"):
        ref = W.reference(name, world=2, **RUN)
        assert W.close(run[name].losses, ref.losses) < 1e-5, \
            f"{name}: losses {W.close(run[name].losses, ref.losses):.2e} from one process's"
        assert len(run[name].norms) == len(ref.norms) == RUN["steps"]
        assert W.close(run[name].norms, ref.norms) < 1e-5, \
            f"{name}: clipped norms {W.close(run[name].norms, ref.norms):.2e} from one process's"  # (its own)
        assert W.max_diff(run[name].state, ref.state) < 2e-5, \
            f"{name}: weights {W.max_diff(run[name].state, ref.state):.2e} from one process's"


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_gather_for_metrics_returns_exactly_the_dataset(results: list, strategy: str) -> None:
    check_metrics(results, strategy)


def check_metrics(results: list, strategy: str) -> None:
    for res in results:
        m = res[f"metrics-{strategy}"]
        assert m["map"]["all"] == list(range(13)), \
            f"{strategy}: the map loader's samples gathered for metrics: {m['map']['all']}"  # in order
        assert sorted(m["map-shuffled"]["all"]) == list(range(13))
        assert m["iterable"]["all"] == list(range(13))
        assert m["map"]["batches"] == 4  # ceil(13 / (2 * 2)) global batches
        assert m["map"]["plain_gather"] == 14  # 12 + the last sample and its one repeat


def test_clip_norm_of_a_subset_is_the_unsharded_norm(results: list) -> None:
    r = results[0]["subset_norm"]
    assert r["norm"] == pytest.approx(r["ref"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["zero2", "zero1"])
def test_accumulate_defers_steps(results: list, strategy: str) -> None:
    r = results[0]["accumulation"][strategy]
    micro, boundary = r["micro"], r["boundary"]
    assert micro["sync"] is False and micro["clip"] is None
    assert W.max_diff(micro["unchanged"], r["before"]) == 0.0
    assert micro["lr"] == [1e-3, 1e-3]
    assert boundary["sync"] is True and boundary["clip"] is not None
    assert W.max_diff(boundary["changed"], r["before"]) > 0
    assert boundary["lr"] == [5e-4, 5e-4]


def test_gather_refuses_shapes_that_differ_across_processes(results: list) -> None:
    for r in results:
        g = r["gather_mismatch"]
        assert g["trailing shape"] == ("gather needs the same dtype and the same shape except dim 0 "
                                       "on every process "
                                       "(dim 0 may differ): rank 0 has float32 (2, 3); "
                                       "rank 1 has float32 (2, 4)")
        assert "rank 0 has float32 (2,); rank 1 has int64 (2,)" in g["dtype"] and "\n" not in g["dtype"]
        assert g["lengths"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert g["max"] == [1.0, 0.0] and g["min"] == [0.0, -1.0]


def _planted_metrics() -> dict[str, Any]:
    import shardwise

    return {"metrics-ddp": _metrics(shardwise.Engine(strategy="ddp", cpu=True, seed=W.SEED))}


def test_gather_for_metrics_keeping_the_repeats_is_caught() -> None:
    caught(check_metrics, spawn(planted(_planted_metrics, "metrics_keep_repeats"), 2), "ddp",
           must=r"^ddp: the map loader's samples gathered for metrics: "
                r"\[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0\]")  # the padding's repeat kept


def _planted_two_models() -> dict[str, W.Trained]:
    import shardwise

    return _two_models(shardwise.Engine(strategy="zero3", cpu=True, grad_accum_steps=2, seed=W.SEED))


def test_a_clip_over_every_model_is_caught() -> None:
    caught(check_two_models, spawn(planted(_planted_two_models, "clip_over_every_model"), 2)[0],
           must=r"^(tiny|gpt2): losses [\d.]+e[-+]\d+ from one process's")
