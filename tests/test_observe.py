"""What a run shows (metrics records, trackers, report) and the rules Accelerate's scripts rely on
(scheduler steps, data order, seeding, resume with dropout), on 2 CPU processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted, planted_here
from spawn import spawn
from torch import nn
from torch.utils.data import DataLoader

STEPS = 4


@dataclass(frozen=True, slots=True)
class Tracked:
    """The tracked run's losses (the script's own means) and clip norms; a Linear built on this
    process before prepare (`init`), and its gathered weights after (`full`)."""

    losses: list[float]
    norms: list[float]
    init: dict[str, torch.Tensor]
    full: dict[str, torch.Tensor]


def _tracked_run(out: str) -> Tracked:
    """zero3, log_with jsonl and tensorboard, a record every step; the script's own mean losses."""
    import shardwise

    engine = shardwise.Engine(strategy="zero3", seed=W.SEED, cpu=True,
                              log_with=["jsonl", "tensorboard", "wandb"],
                              project_dir=out, log_every_steps=1, peak_tflops=1.0, progress=False)
    engine.init_trackers("run", config={"lr": 1e-3})
    model = W.build("gpt2")
    opt = W.make_optimizer(model)
    loader = DataLoader(W.Tokens(engine.num_processes * 2 * STEPS), batch_size=2, shuffle=True)
    model, opt, loader = engine.prepare(model, opt, loader)
    losses, norms = [], []
    for ids in loader:
        loss = W.lm_loss(model, ids)
        engine.backward(loss)
        norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    engine.log({"script_metric": 1.5}, step=engine.step)
    # a model built on processes seeded differently is sharded from process 0's weights
    torch.manual_seed(100 + engine.process_index)
    lin = nn.Linear(8, 8)
    init = {k: v.clone() for k, v in lin.state_dict().items()}
    full = engine.get_state_dict(engine.prepare(lin))
    engine.end_training()
    return Tracked(losses, norms, init, full)


def test_metrics_records_on_rank0_with_loss_throughput_mfu_memory(tmp_path: Path) -> None:
    check_records(spawn(_tracked_run, 2, str(tmp_path)), tmp_path)


def test_a_record_with_one_ranks_memory_is_caught(tmp_path: Path) -> None:
    caught(check_records, spawn(planted(_tracked_run, "memory_of_rank0_only"), 2, str(tmp_path)), tmp_path,
           must=r"^step 1: memory recorded for ranks \[0\]")


def check_records(results: list[Tracked], tmp_path: Path) -> None:
    r0, r1 = results
    assert not torch.equal(r0.init["weight"], r1.init["weight"])
    assert all(torch.equal(r0.full[k], r0.init[k]) for k in r0.init)  # process 0's, not a mix
    path = tmp_path / "logs" / "run" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    records = [x for x in lines if "tokens_per_s" in x]
    assert [x["step"] for x in records] == list(range(1, STEPS + 1))  # one line per logged step
    for rec, loss in zip(records, results[0].losses):
        assert rec["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-6)  # what the script computed
        assert rec["tokens_per_s"] > 0 and rec["samples_per_s"] > 0 and rec["step_time_s"] > 0
        assert 0 < rec["mfu"] < 1 and rec["tflops_per_s"] > 0
        assert [m["rank"] for m in rec["memory"]] == [0, 1], \
            f"step {rec['step']}: memory recorded for ranks {[m['rank'] for m in rec['memory']]}"
        assert all(m["params"] > 0 and m["optimizer"] > 0 and m["peak"] > 0 for m in rec["memory"])
        assert rec["skipped_steps"] == 0 and "loss_scale" not in rec  # fp32: no scaler
    assert [r["grad_norm"] for r in records] == pytest.approx(results[0].norms, rel=1e-6)
    assert [x["script_metric"] for x in lines if "script_metric" in x] == [1.5]
    # rank 0 only: one writer, one file, and nothing else under logs/
    assert sorted(p.name for p in (tmp_path / "logs" / "run").iterdir()
                  if p.suffix in (".jsonl", ".json")) == [
        "config.json", "metrics.jsonl"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "run"))
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("shardwise/loss")]  # the engine's tags, apart from the user's
    assert tb_loss == pytest.approx(results[0].losses, rel=1e-5)
    assert "shardwise/memory/rank1/params" in events.Tags()["scalars"]
    assert [e.value for e in events.Scalars("script_metric")] == [1.5]
    # wandb, offline: one run whose record file holds the per-rank keys and the losses
    (record,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert b"memory/rank1/params" in data and b"tokens_per_s" in data
    assert all(json.dumps(x).encode() in data for x in (records[0]["loss"], records[-1]["loss"]))
    # shardwise report: a PNG and a summary from the JSONL
    proc = subprocess.run([sys.executable, "-m", "shardwise", "report", str(tmp_path / "logs" / "run")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "logs" / "run" / "report.png").stat().st_size > 10_000
    assert "tokens/s" in proc.stdout and f"{STEPS} steps" in proc.stdout


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = W.build("tiny")
        self.drop = nn.Dropout(0.3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.inner(input_ids))


@dataclass(frozen=True, slots=True)
class Rules:
    """What `_rules` measured on one process, in the order it measured them (`state`: the
    Accelerator's use_distributed, num_processes, sync_gradients, free_memory(...), is_last_process)."""

    rand_after_engine: bool
    distributed_type: Any
    mixed_precision: str
    epochs: list[list[int]]
    lr_accelerator: float
    max: float
    min: float
    trigger: bool
    trigger_again: bool
    last: int | None
    no_sync_grad: torch.Tensor
    triggered_grad: torch.Tensor
    uneven: list[list[int]]
    split: list[list[int]]
    state: tuple[Any, ...]


def _rules(out: str) -> Rules:
    """The rules Accelerate's scripts depend on, measured on 2 processes."""
    import shardwise

    # seeding: Engine() without a seed leaves the script's seeding alone
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    engine = shardwise.Accelerator(cpu=True, mixed_precision=None)
    rand_after_engine = torch.allclose(torch.rand(3), expected)
    distributed_type = engine.distributed_type
    mixed_precision = engine.mixed_precision
    # data order: the loader's own generator decides it, as in plain torch
    data = list(range(24))
    loader = engine.prepare(DataLoader(data, batch_size=3, shuffle=True,
                                       generator=torch.Generator().manual_seed(5)))
    epochs = [torch.cat(engine.gather(list(loader))).tolist() for _ in range(2)]
    # the scheduler: once per process per optimizer step under Accelerator
    lr_accelerator = _lr_after_three_steps(engine)
    # reduce max/min
    top = engine.reduce(torch.tensor([float(engine.process_index)]), "max").item()
    bottom = engine.reduce(torch.tensor([float(engine.process_index)]), "min").item()
    # triggers
    if engine.process_index == 1:
        engine.set_trigger()
    trigger = engine.check_trigger()
    trigger_again = engine.check_trigger()
    last = engine.on_last_process(lambda: engine.process_index)()
    # no_sync keeps gradients local; trigger_sync_in_backward all-reduces one backward anyway (DDP)
    torch.manual_seed(0)
    net = engine.prepare(nn.Linear(2, 1, bias=False))
    x = torch.tensor([[1.0 + engine.process_index, 2.0]])
    with engine.no_sync(net):
        engine.backward(net(x).sum())
    no_sync_grad = net.module.weight.grad.clone()
    net.module.weight.grad = None
    with engine.no_sync(net), engine.trigger_sync_in_backward(net):
        engine.backward(net(x).sum())
    triggered_grad = net.module.weight.grad.clone()
    # even_batches=False: the last batch as it is; split_batches: the loader's batch is the global one
    uneven_engine = shardwise.Accelerator(
        cpu=True, dataloader_config=shardwise.DataLoaderConfiguration(even_batches=False))
    uneven = [b.tolist() for b in uneven_engine.prepare(DataLoader(list(range(10)), batch_size=3))]
    split_engine = shardwise.Accelerator(
        cpu=True, dataloader_config=shardwise.DataLoaderConfiguration(split_batches=True))
    split = [b.tolist() for b in split_engine.prepare(DataLoader(list(range(8)), batch_size=4))]
    state = (engine.use_distributed, engine.state.num_processes, engine.gradient_state.sync_gradients,
             engine.free_memory(net, x), engine.is_last_process)
    engine.end_training()
    return Rules(rand_after_engine, distributed_type, mixed_precision, epochs, lr_accelerator, top, bottom,
                 trigger, trigger_again, last, no_sync_grad, triggered_grad, uneven, split, state)


def _lr_after_three_steps(engine: Any) -> float:
    """A LambdaLR 1/(1+s) prepared with its optimizer, after 3 optimizer steps."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = engine.prepare(model, opt, sched)
    for _ in range(3):
        engine.backward(model(torch.ones(1, 2)).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
    return float(sched.get_last_lr()[0])


def _resume_with_dropout(out: str, phase: str) -> list[float]:
    """8 steps with dropout straight, or 4 + save (mid-epoch) then, in new processes, load + 4:
    the losses (averaged over processes)."""
    import shardwise

    torch.manual_seed(3)
    engine = shardwise.Engine(strategy="zero2", cpu=True, checkpoint_dir=out, progress=False)
    model = _Dropout()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(W.Tokens(2 * 2 * 12), batch_size=2, shuffle=True)
    model, opt, loader = engine.prepare(model, opt, loader)
    if phase == "second":
        engine.load_state()
    losses = []
    for ids in loader:
        loss = nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, W.VOCAB), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
        if phase == "first" and engine.step == 4:
            engine.save_state()
            break
        if engine.step == 8:
            break
    return losses


def test_accelerate_rules_on_two_processes(tmp_path: Path) -> None:
    check_rules(*spawn(_rules, 2, str(tmp_path)))


def test_an_engine_that_seeds_the_script_is_caught(tmp_path: Path) -> None:
    caught(check_rules, *spawn(planted(_rules, "engine_seeds_torch"), 2, str(tmp_path)),
           must=r"^the script's set_seed stands after the Engine: False, False")


def check_rules(r0: Rules, r1: Rules) -> None:
    assert r0.rand_after_engine and r1.rand_after_engine, \
        f"the script's set_seed stands after the Engine: {r0.rand_after_engine}, {r1.rand_after_engine}"
    assert r0.distributed_type == "MULTI_CPU" and r0.mixed_precision == "no"
    # data order: the generator's, exactly what plain torch gives one process for the same loader
    g = torch.Generator().manual_seed(5)
    plain = DataLoader(list(range(24)), batch_size=3, shuffle=True, generator=g)
    expect = [[int(i) for b in plain for i in b] for _ in range(2)]

    for epoch in range(2):
        # gathered batch k is [rank 0's k-th batch, rank 1's]: global batch k of the epoch's order
        assert r0.epochs[epoch] == expect[epoch]
    # 3 optimizer steps x 2 processes scheduler steps: lr = 1/(1+6)
    assert r0.lr_accelerator == pytest.approx(1 / 7)
    assert (r0.max, r0.min) == (1.0, 0.0)
    assert r0.trigger and r1.trigger and not r0.trigger_again
    assert (r0.last, r1.last) == (None, 1)
    assert not torch.equal(r0.no_sync_grad, r1.no_sync_grad)  # each its own x
    assert torch.equal(r0.triggered_grad, r1.triggered_grad)  # averaged in that backward
    assert torch.allclose(r0.triggered_grad, (r0.no_sync_grad + r1.no_sync_grad) / 2)
    assert (r0.uneven, r1.uneven) == ([[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]])
    assert (r0.split, r1.split) == ([[0, 1], [4, 5]], [[2, 3], [6, 7]])
    assert r0.state == (True, 2, True, (None, None), False) and r1.state[4] is True


def test_mid_epoch_resume_is_bit_exact_with_dropout(tmp_path: Path) -> None:
    check_resumed(tmp_path, _resume_with_dropout)


def test_a_resume_at_the_epochs_start_is_caught(tmp_path: Path) -> None:
    caught(check_resumed, tmp_path, planted(_resume_with_dropout, "loader_position_dropped"),
           must=r"^losses after the resume \[[\d., ]+\], the straight run's \[")


def check_resumed(tmp_path: Path, second_half: Any) -> None:
    """8 steps straight against 4 + save + new processes (`second_half`) + load + 4."""
    straight = spawn(_resume_with_dropout, 2, str(tmp_path / "a"), "straight")[0]
    first = spawn(_resume_with_dropout, 2, str(tmp_path / "b"), "first")[0]
    second = spawn(second_half, 2, str(tmp_path / "b"), "second")[0]
    assert len(straight) == 8
    assert first + second == straight, \
        f"losses after the resume {second}, the straight run's {straight[len(first):]}"  # bit for bit


def _engine_scheduler(out: str) -> float:
    import shardwise

    return _lr_after_three_steps(shardwise.Engine(cpu=True, progress=False))


def test_engine_keeps_its_scheduler_rule(tmp_path: Path) -> None:
    assert spawn(_engine_scheduler, 2, str(tmp_path)) == [pytest.approx(1 / 4)] * 2


PROGRESS_SCRIPT = """
import torch, shardwise, workloads as W
from torch.utils.data import DataLoader
engine = shardwise.Engine(cpu=True, seed=0, progress=True, log_every_steps=1)
model = W.build("tiny")
opt = W.make_optimizer(model)
model, opt, loader = engine.prepare(model, opt, DataLoader(W.Tokens(6), batch_size=2, shuffle=True))
for ids in loader:
    engine.backward(W.lm_loss(model, ids))
    opt.step()
    opt.zero_grad()
engine.end_training()
"""


def test_progress_bar_shows_step_loss_and_eta(tmp_path: Path) -> None:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROGRESS_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bar = proc.stderr.replace("\r", "\n")
    assert "3/3" in bar and "loss=" in bar and "step" in bar  # steps of the epoch, with the loss
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", bar)  # elapsed<remaining: the ETA


def test_log_refuses_a_non_scalar_in_one_line_naming_its_key(tmp_path: Path) -> None:
    """A tensor of several elements in `log()` is a one-line error naming the key (it crashed the
    JSONL writer); one-element tensors and numpy scalars are numbers, written as such."""
    check_log_values(tmp_path)


def test_a_tensor_logged_as_a_list_is_caught(tmp_path: Path) -> None:
    with planted_here("log_tensors_as_lists"):
        caught(check_log_values, tmp_path, must=r"DID NOT RAISE .*ValueError")  # the 2x3 tensor taken


def check_log_values(tmp_path: Path) -> None:
    import numpy as np

    import shardwise

    engine = shardwise.Engine(strategy="ddp", cpu=True, log_with="jsonl", project_dir=str(tmp_path),
                              progress=False)
    engine.init_trackers("run")
    with pytest.raises(ValueError, match=r"^log\(\): 'eval/logits' is a Tensor of shape \(2, 3\), "
                       r"not a scalar; "
                       r"log a number \(e\.g\. \.mean\(\)\.item\(\)\) or one key per element$"):
        engine.log({"loss": 1.0, "eval": {"logits": torch.ones(2, 3)}}, step=1)
    with pytest.raises(ValueError, match=r"^log\(\): 'model' is a Linear, not a number"):
        engine.log({"model": nn.Linear(1, 1)}, step=1)
    engine.log({"acc": torch.tensor([0.5]), "n": np.float32(2.0), "name": "a"}, step=2)
    engine.end_training()
    lines = [json.loads(x) for x in (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in x.items() if k != "time"} for x in lines] == [
        {"step": 2, "acc": 0.5, "n": 2.0, "name": "a"}]


def test_report_reads_what_a_crash_left_whole(tmp_path: Path) -> None:
    """A metrics.jsonl whose last line was cut by a crash: the whole lines are reported, and one
    line names the file, the line and the bytes left out; a damaged line before the end is refused."""
    check_report_of_a_cut_file(tmp_path)


def test_a_report_silent_on_a_cut_line_is_caught(tmp_path: Path) -> None:
    with planted_here("cut_line_unsaid"):
        caught(check_report_of_a_cut_file, tmp_path, must=r"^the report's first line: '3 steps, 3 records'")


def check_report_of_a_cut_file(tmp_path: Path) -> None:
    from shardwise.config import ConfigError
    from shardwise.runtime.report import report

    run = tmp_path / "run"
    run.mkdir()
    whole = "".join(json.dumps({"step": s, "loss": 1.0 / s, "step_time_s": 0.1}) + "\n" for s in (1, 2, 3))
    cut = '{"step": 4, "loss": 0.2'
    (run / "metrics.jsonl").write_text(whole + cut)
    png, text = report(run)
    assert text.splitlines()[0] == (f"skipped {run / 'metrics.jsonl'}:4: {len(cut)} bytes of an "
                                    "unfinished last line "
                                    "(the run stopped while writing it)"), \
        f"the report's first line: {text.splitlines()[0]!r}"
    assert "3 steps, 3 records" in text and png.is_file()
    (run / "metrics.jsonl").write_text(cut + "\n" + whole)
    with pytest.raises(ConfigError, match=r"metrics\.jsonl:1: not a JSON line .*; the file is damaged"):
        report(run)
