"""`shardwise plan` with expert parallelism (`--expert-parallel-size`, `PlanRequest.expert_parallel_size`).

The planner traces the real expert-parallel step on fake ranks, its routing even
(`fakes.even_routing`: fake tensors hold no router output). Checked here, on the tiny Mixtral
and Qwen2-MoE of `test_expert_parallel.py` (4 experts, top 2, 2 layers, 16 tokens, batch 2):

  counts        in process, 4 fake ranks: the all-to-all bytes each rank sends per step are
                4 exchanges (6 under full activation checkpointing: the recompute's forward
                sends again) x layers x T x k hidden-size fp32 rows x (N-1)/N, derived from the
                model's config; the data-parallel collectives run on the parameters outside the
                experts over every rank, and on 1/N of the experts over the W/N ranks holding
                the same ones (nothing at N = W), derived from the counted parameters.
  measured      2 gloo processes, the loop the planner traces (`out = model(**batch)`,
                `engine.backward(out.loss)`, `step`, `zero_grad`), each plan's predicted peak of
                live tensor bytes within 5% of rank 0's measured peak (an independent counter,
                `test_plan.LiveStorage`), zero3 and zero2 alone and with ep 2; the all-to-all
                bytes the real dispatch sent over the two steps within 35% of the plan's (the
                router of a freshly initialised model is near even, not exactly: the
                bytes a routing sends are fixed by it, `test_expert_parallel.py`).
  auto          `Engine(strategy="auto", expert_parallel_size=2)` at 2 processes picks an ep 2
                plan and trains the same model as that strategy named (losses and weights equal).
  hybrid        in process, 8 fake ranks on one node and on two: hybrid groups with ep
                dividing them, every byte derived (the rest over its group and the replicas,
                the experts over their holders and the replicas) on the link its group crosses;
                at 4 gloo processes (2 replicas of 2, ep 2) the predicted peak and all-to-all
                against the measured, as at 2.
  refusals      one line, before tracing: a model with no experts, a size that does not divide
                the experts, the devices or a hybrid group, ep with tensor parallelism, ep on ddp.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from planted import caught, planted
from spawn import spawn
from test_expert_parallel import SEQ, VOCAB, build
from test_plan import TOLERANCE, peak_of_steps

from shardwise import cli
from shardwise.plan import Candidate, Plan, PlanRequest, plan_module
from shardwise.plan.comm import BOUNDARY_BYTES
from shardwise.plan.presets import PlanError
from shardwise.plan.report import describe

BATCH, LAYERS, TOP_K, HIDDEN = 2, 2, 2, 32
REAL = [Candidate("zero3"), Candidate("zero3", expert_parallel_size=2), Candidate("zero2"),
        Candidate("zero2", expert_parallel_size=2), Candidate("zero1"),
        Candidate("zero1", expert_parallel_size=2)]


def _batch(batch: int = BATCH) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}


def _plan(family: str, world: int, cands: list[Candidate]) -> Plan:
    torch.manual_seed(0)
    request = PlanRequest(world_size=world, device_memory="1TB", device="cpu", candidates=tuple(cands))
    return plan_module(build(family), _batch(), request)


def _experts(model: torch.nn.Module) -> int:
    from shardwise.strategies.expert_parallel import EXPERT_PARAMS, experts_modules

    return sum(getattr(m, p).numel() for _, m in experts_modules(model) for p in EXPERT_PARAMS)


COUNTED = [Candidate("zero3"), Candidate("zero3", expert_parallel_size=2),
           Candidate("zero3", expert_parallel_size=4), Candidate("zero2", expert_parallel_size=2),
           Candidate("zero3", "none", True, expert_parallel_size=2),
           Candidate("zero1", expert_parallel_size=2)]


def _counts(family: str) -> dict[str, Any]:
    """What the counts check reads from a plan at 4 fake ranks (picklable, for a planted worker)."""
    plan = _plan(family, 4, COUNTED)
    return {"plans": [(p.candidate, p.comm, p.compute_seconds) for p in plan.plans], "text": describe(plan),
            "settings": plan.find("zero3", expert_parallel_size=2).settings()}


def _check_counts(family: str, counts: dict[str, Any]) -> None:
    world = 4
    model = build(family)
    total, experts = sum(p.numel() for p in model.parameters()), _experts(model)
    assert 0 < experts < total
    row = BATCH * SEQ * TOP_K * HIDDEN * 4  # one exchange's full buffer: T x k fp32 hidden rows
    found = {c: (sent, compute) for c, sent, compute in counts["plans"]}
    assert set(found) == set(COUNTED)
    for c, (sent, _) in found.items():
        assert sent is not None and not sent.inter, c.name
        ep = c.expert_parallel_size
        exchanges = 6 if c.checkpointed else 4
        expected = exchanges * LAYERS * row * (ep - 1) / ep
        assert sent.intra.get("all_to_all", 0.0) == pytest.approx(expected, rel=1e-9), \
            f"{c.name}: all_to_all {sent.intra.get('all_to_all', 0.0)} bytes, not {expected}"
        edp = world // ep
        dense = (total - experts) if ep > 1 else total
        held = experts / ep if ep > 1 else 0
        if c.strategy == "zero1":  # DDP all-reduces the rest over every rank, the experts over
            # their holders; the updated fp32 slices all-gathered over the same ranks
            reduced = 2 * (4 * dense + BOUNDARY_BYTES) * (world - 1) / world + 2 * 4 * held * (edp - 1) / edp
            assert sent.intra["all_reduce"] == pytest.approx(reduced, rel=1e-9), c.name
            gathered = 4 * (dense * (world - 1) / world + held * (edp - 1) / edp)
            assert sent.intra["all_gather"] == pytest.approx(gathered, rel=1e-9), c.name
            assert "reduce_scatter" not in sent.intra, c.name
            continue
        # zero3 gathers twice, zero2 once; gradients reduce-scattered once, fp32
        gathers = 2 if c.strategy == "zero3" else 1
        gathered = 4 * (gathers * dense * (world - 1) / world + gathers * held * (edp - 1) / edp)
        assert sent.intra["all_gather"] == pytest.approx(gathered, rel=1e-9), c.name
        scattered = 4 * (dense * (world - 1) / world + held * (edp - 1) / edp)
        assert sent.intra["reduce_scatter"] == pytest.approx(scattered, rel=1e-9), c.name
    # every expert's FLOPs counted with or without the split (balanced: each rank computes T x k
    # slots either way), so the plans' compute time is the same
    alone = found[Candidate("zero3")][1]
    for ep in (2, 4):
        assert found[Candidate("zero3", expert_parallel_size=ep)][1] == pytest.approx(alone, rel=1e-6)
    assert "zero3 + ep 2" in counts["text"] and "all-to-all" in counts["text"]
    assert counts["settings"]["expert_parallel_size"] == 2


@pytest.mark.parametrize("family", ["mixtral", "qwen"])
def test_planned_all_to_all_and_collectives_are_the_derived_bytes(family: str) -> None:
    _check_counts(family, _counts(family))


def test_a_planner_that_gathers_the_experts_is_caught() -> None:
    counts = spawn(planted(_counts, "plan_experts_gathered"), 1, "mixtral")[0]
    caught(_check_counts, "mixtral", counts, must=r"^zero3 \+ ep 2: all_to_all 0\.0 bytes, not 32768")


def _measure(cands: list[Candidate]) -> dict[str, Any]:
    import shardwise
    from shardwise.strategies.expert_parallel import sent_bytes

    torch.manual_seed(0)
    template = build("mixtral")
    peaks, sent = [], []
    for cand in cands:
        engine = shardwise.Engine(strategy=cand.strategy, cpu=True, shard_group_size=cand.shard_group_size,
                                  expert_parallel_size=cand.expert_parallel_size)
        model = copy.deepcopy(template)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1 + engine.process_index)
        sent_bytes()  # (prepare dispatches nothing)
        peaks.append(peak_of_steps(engine, model, optimizer, _batch, 2))
        sent.append(sent_bytes())
        engine.end_training()
        del model, optimizer, engine
        gc.collect()
    return {"peaks": peaks, "sent": sent}


def _auto() -> dict[str, Any]:
    """The same 3 steps under strategy="auto" with expert_parallel_size 2, then under the strategy
    it chose, named: losses and gathered weights."""
    import shardwise

    out: dict[str, Any] = {}
    for strategy in ("auto", "named"):
        engine = shardwise.Engine(strategy=out.get("chosen", "auto"), cpu=True, expert_parallel_size=2,
                                  seed=0)
        torch.manual_seed(0)
        model = build("mixtral")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(7)
        ids = torch.randint(0, VOCAB, (12, SEQ))  # 3 batches of 2 per rank
        samples = [{"input_ids": i, "labels": i.clone()} for i in ids]
        loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
        model, optimizer, loader = engine.prepare(model, optimizer, loader)
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[strategy] = (losses, engine.get_state_dict(model))
        if strategy == "auto":
            assert engine.plan is not None and engine.plan.best is not None
            best = engine.plan.best.candidate
            out["chosen"], out["ep"] = best.strategy, best.expert_parallel_size
        engine.end_training()
    return out


def _spawned(cands: list[Candidate]) -> dict[str, Any]:
    return {"measured": _measure(cands), "auto": _auto()}


def test_predicted_peak_and_all_to_all_match_real_two_process_runs() -> None:
    results = spawn(_spawned, 2, REAL)
    measured = results[0]["measured"]
    plan = _plan("mixtral", 2, REAL)
    report = []
    for cand, real, sent in zip(REAL, measured["peaks"], measured["sent"]):
        p = plan.find(cand.strategy, expert_parallel_size=cand.expert_parallel_size)
        err = p.peak / real - 1
        assert p.comm is not None
        planned = 2 * p.comm.intra.get("all_to_all", 0.0)  # two steps
        report.append(f"{cand.name:14s} predicted {p.peak / 2**10:8.1f} KiB measured {real / 2**10:8.1f} KiB "
                      f"{err:+.2%}  all-to-all planned {planned:8.0f} B sent {sent:8.0f} B")
        assert abs(err) <= TOLERANCE, "\n".join(report)
        if cand.expert_parallel_size > 1:
            assert abs(sent / planned - 1) <= 0.35, "\n".join(report)
        else:
            assert sent == 0 and planned == 0
    print("\n".join(report))
    auto = results[0]["auto"]
    assert auto["ep"] == 2 and auto["chosen"] in ("zero1", "zero2", "zero3")
    (losses, state), (named_losses, named_state) = auto["auto"], auto["named"]
    assert losses == named_losses and len(losses) == 3
    assert state.keys() == named_state.keys()
    assert all(torch.equal(state[k], named_state[k]) for k in state)


HYBRID = [Candidate("zero3", shard_group_size=4, expert_parallel_size=2),
          Candidate("zero2", shard_group_size=4, expert_parallel_size=4),
          Candidate("zero1", shard_group_size=4, expert_parallel_size=2),
          Candidate("zero3", shard_group_size=2, expert_parallel_size=2)]


def _hybrid_comms(nodes: int) -> list[Any]:
    """Each HYBRID candidate's planned bytes at 8 fake ranks on `nodes` nodes (picklable)."""
    torch.manual_seed(0)
    request = PlanRequest(world_size=8, nodes=nodes, device_memory="1TB", device="cpu",
                          candidates=tuple(HYBRID))
    plan = plan_module(build("mixtral"), _batch(), request)
    return [plan.find(c.strategy, shard_group_size=c.shard_group_size,
                      expert_parallel_size=c.expert_parallel_size).comm for c in HYBRID]


@pytest.mark.parametrize("nodes", [1, 2])
def test_hybrid_sharding_with_expert_parallelism_plans_the_derived_bytes(nodes: int) -> None:
    _check_hybrid(nodes, _hybrid_comms(nodes))


def test_a_planner_ignoring_the_hybrid_group_under_ep_is_caught() -> None:
    comms = spawn(planted(_hybrid_comms, "plan_hybrid_experts_whole_world"), 1, 1)[0]
    caught(_check_hybrid, 1, comms,
           must=r"^\('zero3 hybrid 4 \+ ep 2', 'intra', 'all_reduce'\)\nassert 28\.0 == 47548\.0")


def _check_hybrid(nodes: int, comms: list[Any]) -> None:
    """8 fake ranks, hybrid groups of G with ep N dividing G (R = 8 / G replicas, e = G / N edp
    ranks), on one node or two of 4: the rest of the model sharded within its group and reduced
    across the replicas, the experts (1/N) over their e holders and across the replicas (zero1:
    all-reduced over the replicas, then the holders, who split the optimizer step), each byte
    derived from the counted parameters here and put on the link its group crosses."""
    world = 8
    model = build("mixtral")
    total, x = sum(p.numel() for p in model.parameters()), _experts(model)
    d = total - x
    row = BATCH * SEQ * TOP_K * HIDDEN * 4

    def ring(nbytes: float, n: int, reduce: bool = False) -> float:
        return (2 if reduce else 1) * nbytes * (n - 1) / n

    for c, found in zip(HYBRID, comms):
        g, n = c.shard_group_size, c.expert_parallel_size
        assert g is not None
        r, e = world // g, g // n
        across = "inter" if nodes > 1 else "intra"  # the replicas, and every rank, span the nodes
        want: dict[str, dict[str, float]] = {"intra": {}, "inter": {}}

        def add(link: str, kind: str, nbytes: float, want: dict[str, dict[str, float]] = want) -> None:
            if nbytes:
                want[link][kind] = want[link].get(kind, 0.0) + nbytes

        add(across, "all_reduce", ring(16, world, reduce=True))  # the step boundary's flags
        add("intra", "all_to_all", 4 * LAYERS * row * (n - 1) / n)
        if c.strategy == "zero1":
            add(across, "all_reduce", ring(4 * d, world, reduce=True))
            add("intra", "all_gather", ring(4 * d, g))
            add(across, "all_reduce", ring(4 * x / n, r, reduce=True))
            add("intra", "all_reduce", ring(4 * x / n, e, reduce=True))
            add("intra", "all_gather", ring(4 * x / n, e))
        else:
            gathers = 2 if c.strategy == "zero3" else 1
            for part, size in ((d, g), (x / n, e)):
                add("intra", "all_gather", gathers * ring(4 * part, size))
                add("intra", "reduce_scatter", ring(4 * part, size))
                add(across, "all_reduce", ring(4 * part / size, r, reduce=True))
        assert found is not None
        for link in ("intra", "inter"):
            got = getattr(found, link)
            assert set(got) == set(want[link]), (c.name, link, got, want[link])
            for kind, nbytes in want[link].items():
                assert got[kind] == pytest.approx(nbytes, rel=1e-9), (c.name, link, kind)


MEASURED_HYBRID = [Candidate("zero3", shard_group_size=2, expert_parallel_size=2),
                   Candidate("zero1", shard_group_size=2, expert_parallel_size=2)]


def test_hybrid_plans_with_expert_parallelism_predict_real_four_process_runs() -> None:
    """2 replicas of 2 with ep 2 at 4 gloo processes: each plan's predicted peak of live tensor
    bytes within the planner's tolerance of rank 0's measured peak, and the all-to-all bytes the
    real dispatch sent within 35% of the plan's (as at 2 processes above)."""
    measured = spawn(_measure, 4, MEASURED_HYBRID)[0]
    plan = _plan("mixtral", 4, MEASURED_HYBRID)
    report = []
    for cand, real, sent in zip(MEASURED_HYBRID, measured["peaks"], measured["sent"]):
        p = plan.find(cand.strategy, shard_group_size=2, expert_parallel_size=2)
        assert p.comm is not None
        err, planned = p.peak / real - 1, 2 * p.comm.intra["all_to_all"]  # two steps
        report.append(f"{cand.name:22s} predicted {p.peak / 2**10:8.1f} KiB measured {real / 2**10:8.1f} KiB "
                      f"{err:+.2%}  all-to-all planned {planned:8.0f} B sent {sent:8.0f} B")
        assert abs(err) <= TOLERANCE and abs(sent / planned - 1) <= 0.35, "\n".join(report)
    print("\n".join(report))


def test_cli_plans_expert_parallelism_for_a_config_json(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = build("mixtral").config
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.save_pretrained(tmp_path)
    code = cli.main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "2", "--gpu-memory", "1TB",
                     "--device", "cpu",
                     "--seq-len", str(SEQ), "--batch", "2", "--expert-parallel-size", "2",
                     "--no-activation-checkpointing"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "zero3 + ep 2" in text and "zero2 + ep 2" in text and "all-to-all" in text, text


def _one_line(err: pytest.ExceptionInfo[BaseException], *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_refusals_are_one_line_before_tracing() -> None:
    from torch import nn

    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sample = torch.zeros(2, 4)
    with pytest.raises(PlanError) as err:
        plan_module(plain, sample, PlanRequest(world_size=2, device_memory="1TB", device="cpu",
                                               expert_parallel_size=2))
    _one_line(err, "--expert-parallel-size 2", "no mixture-of-experts layer")
    with pytest.raises(PlanError) as err:
        plan_module(build("mixtral"), _batch(), PlanRequest(world_size=8, device_memory="1TB", device="cpu",
                                                            expert_parallel_size=8))
    _one_line(err, "does not divide", "4 experts")
    cases = [
        ({"world_size": 4, "expert_parallel_size": 3}, ("--expert-parallel-size 3", "divides the 4 devices")),
        ({"world_size": 4, "expert_parallel_size": 2, "tensor_parallel_size": 2}, ("plan it alone",)),
        ({"world_size": 2, "candidates": (Candidate("ddp", expert_parallel_size=2),)},
         ("zero1, zero2 or zero3",)),
        ({"world_size": 8, "candidates": (Candidate("zero3", shard_group_size=2, expert_parallel_size=4),)},
         ("zero3 hybrid 2 + ep 4", "does not divide the sharding group of 2")),
    ]
    for kwargs, words in cases:
        with pytest.raises(PlanError) as err:
            PlanRequest(device_memory="1TB", device="cpu", **kwargs).check()  # type: ignore[arg-type]
        _one_line(err, *words)
