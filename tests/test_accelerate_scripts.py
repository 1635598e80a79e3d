"""Scripts written for Hugging Face Accelerate run with only their import changed, and give
Accelerate's numbers: each script in tests/accelerate_scripts/ runs under Accelerate itself (the
reference) and as `from shardwise import Accelerator` under ddp and zero3, 2 CPU processes each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from spawn import GLOO_ABORT, kill_tree

pytest.importorskip("accelerate")  # the reference; installed by `make test` (the test extra)
HERE = Path(__file__).parent / "accelerate_scripts"
IMPORT = "from accelerate import Accelerator\n"


def _swapped(name: str, tmp: Path, folder: Path = HERE, line: str = IMPORT,
             ours: str = "from shardwise import Accelerator\n") -> Path:
    """The script `folder/name` with its one import `line` changed (to `ours`), and nothing else."""
    original = (folder / name).read_text()
    assert original.count(line) == 1
    swapped = tmp / name
    swapped.write_text(original.replace(line, ours))
    return swapped


def _results(out: Path) -> dict | None:
    """The run's results file: None when it wrote none, {} when it is cut short."""
    try:
        return json.loads(out.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return {}


def _launch(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """The launcher's exit code (None: still running after `timeout` seconds, then killed with
    every worker it started) and its stderr."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun's workers too (sessions of their own)
        _, err = proc.communicate()
        return None, err
    return proc.returncode, err


def _run(script: Path, tmp: Path, label: str, config: str | None, *extra: str, reference: bool = False,
         timeout: float = 300, env: dict[str, str] | None = None) -> dict:
    """The results of `script` on 2 processes under torchrun; the run must exit 0 within `timeout`
    seconds with results that say it finished (`"done": true`, written after `end_training()`).

    Two exceptions, each printed with the run's name:
    - `reference=True` (the script under Accelerate itself): Accelerate's runs sometimes write
      their results and then hang or abort in gloo's process-group teardown at exit
      (../shared/notes/deepspeed-on-cpu.md); such a run, with complete results, is stopped and
      counted. A shardwise run that does the same fails: a teardown bug.
    - gloo's start-up abort (`spawn.GLOO_ABORT` before the run recorded anything) is run once
      more; an abort after the run recorded results is not retried (it hides a teardown bug)."""
    out = tmp / f"{label}.json"
    env = {**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("SHARDWISE_CONFIG", None)
    if config is not None:
        cfg = tmp / f"{label}.yaml"
        cfg.write_text(config)
        env["SHARDWISE_CONFIG"] = str(cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--cpu", "--out", str(out), "--project_dir", str(tmp / label), *extra]
    for attempt in (1, 2):
        out.unlink(missing_ok=True)
        code, err = _launch(cmd, env, timeout)
        results = _results(out)
        finished = bool(results and results.get("done"))
        if reference and finished and (code is None or (code != 0 and GLOO_ABORT in err)):
            why = f"hung for {timeout} s" if code is None else f"exited {code}"
            print(f"{label}: Accelerate's known teardown fault: the reference run wrote complete results, "
                  f"then {why} at exit; counted")
            return results  # type: ignore[return-value]
        if code is None:
            pytest.fail(f"{label}: still running after {timeout} s (a hang; results "
                        f"{'complete' if finished else 'incomplete' if results is not None else 'absent'})\n"
                        f"{err[-4000:]}")
        if code != 0 and GLOO_ABORT in err and results is None and attempt == 1:
            message = f"{label}: gloo aborted at start-up (before any results), run once more"
            print(message)
            warnings.warn(message, stacklevel=2)
            continue
        if code != 0 and GLOO_ABORT in err:
            when = "after the run recorded results (at teardown)" if results is not None else "twice"
            pytest.fail(f"{label}: gloo aborted {when}: not retried\n{err[-4000:]}")
        assert code == 0, f"{label}: exited {code}\n{err[-4000:]}"
        assert finished, f"{label}: exited 0 but its results do not say it finished: {results}\n{err[-4000:]}"
        return results  # type: ignore[return-value]
    raise AssertionError("unreachable")


def test_classifier_script_gives_accelerates_numbers(tmp_path: Path) -> None:
    ours = _swapped("train_classifier.py", tmp_path)
    ref = _run(HERE / "train_classifier.py", tmp_path, "accelerate", None, reference=True)
    for strategy, tol in (("ddp", 1e-5), ("zero3", 1e-4)):
        got = _run(ours, tmp_path, strategy, f"strategy: {strategy}\n")
        assert got["distributed_type"] == ("MULTI_CPU" if strategy == "ddp" else "FSDP")
        for key in ("mixed_precision", "num_processes", "multi", "steps"):
            assert got[key] == ref[key], key
        assert len(got["losses"]) == len(ref["losses"]) == 2 * 13  # 100 samples / (2 x 4) per epoch
        worst = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        assert worst <= tol, f"{strategy}: loss curve differs from Accelerate's by {worst:.2e}"
        assert got["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)  # the schedule steps as Accelerate's
        for g, r in zip(got["metrics"], ref["metrics"], strict=True):
            assert g["n"] == r["n"] == 37  # gather_for_metrics dropped the padded duplicates
            assert g["accuracy"] == pytest.approx(r["accuracy"], abs=1 / 37)
            assert g["f1"] == pytest.approx(r["f1"], abs=0.03)
        # automatic checkpoint naming with total_limit=2: checkpoint_0 and checkpoint_1
        names = sorted(p.name for p in (tmp_path / strategy / "checkpoints").iterdir())
        assert names == ["checkpoint_0", "checkpoint_1"]


CHECKPOINTING = HERE / "checkpoint_resume.py"


def _checkpointing_run(tmp: Path, path: Path, label: str, config: str | None, *extra: str,
                       env: dict[str, str] | None = None) -> dict:
    return _run(path, tmp, label, config, "--output_dir", str(tmp / f"{label}_ckpt"),
                "--checkpointing_steps", "21", *extra, reference=path == CHECKPOINTING, env=env)


@pytest.fixture(scope="module")
def checkpointing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Accelerate's straight and resumed runs of checkpoint_resume.py, and shardwise's straight ddp
    run, whose step_21 checkpoint the resumed runs below start from."""
    tmp = tmp_path_factory.mktemp("checkpointing")
    ref = _checkpointing_run(tmp, CHECKPOINTING, "acc", None)
    ref_resumed = _checkpointing_run(tmp, CHECKPOINTING, "acc_resumed", None, "--resume_from_checkpoint",
                                     str(tmp / "acc_ckpt" / "step_21"))
    ours = _swapped("checkpoint_resume.py", tmp)
    got = _checkpointing_run(tmp, ours, "ddp", "strategy: ddp\n")
    return {"tmp": tmp, "ours": ours, "ref": ref, "ref_resumed": ref_resumed, "got": got}


def _resumed_into_zero3(runs: dict[str, Any], label: str, env: dict[str, str] | None = None) -> dict:
    return _checkpointing_run(runs["tmp"], runs["ours"], label, "strategy: zero3\n",
                              "--resume_from_checkpoint", str(runs["tmp"] / "ddp_ckpt" / "step_21"), env=env)


def test_checkpointing_script_gives_accelerates_numbers_and_resumes_as_accelerate(
        checkpointing: dict[str, Any]) -> None:
    """The straight run equals Accelerate's. A run resumed from step 21 (mid-epoch, on an
    accumulation boundary; the script skips the seen batches with skip_first_batches), from a ddp
    checkpoint into zero3, equals Accelerate's resumed run: the weights, optimizer, scheduler,
    sampler epoch and RNG come back, and the resumed pass draws its iterator seed again, as
    Accelerate's does (so with dropout neither equals its uninterrupted run; `Engine` does)."""
    check_checkpointing(checkpointing, _resumed_into_zero3(checkpointing, "zero3_resumed"))


def test_planted_scheduler_not_restored_is_caught(checkpointing: dict[str, Any]) -> None:
    """`scheduler_not_restored`: the resumed run's OneCycleLR starts over; the check's learning
    rates (and losses) differ from Accelerate's resumed run."""
    from planted import caught, fault_env

    resumed = _resumed_into_zero3(checkpointing, "planted", env=fault_env("scheduler_not_restored"))
    caught(check_checkpointing, checkpointing, resumed,
           must=r"^resumed: per-process losses differ from Accelerate's by")


def check_checkpointing(runs: dict[str, Any], resumed: dict) -> None:
    ref, ref_resumed, got = runs["ref"], runs["ref_resumed"], runs["got"]
    assert len(ref["losses"]) == 45 and resumed["losses"][0][0] == 22
    assert (ref_resumed["lrs"] == pytest.approx(ref["lrs"][21:])
            and ref_resumed["losses"] != ref["losses"][21:])
    for label, a, b, tol in (("straight", got, ref, 1e-6), ("resumed", resumed, ref_resumed, 1e-5)):
        assert [s for s, _ in a["losses"]] == [s for s, _ in b["losses"]], label
        worst = max(abs(x - y) for (_, xs), (_, ys) in zip(a["losses"], b["losses"]) for x, y in zip(xs, ys))
        assert worst <= tol, f"{label}: per-process losses differ from Accelerate's by {worst:.2e}"
        # OneCycleLR, guarded at its end
        assert a["lrs"] == pytest.approx(b["lrs"], rel=1e-9, abs=1e-12), label
        for x, y in zip(a["metrics"], b["metrics"], strict=True):
            assert (x["epoch"], x["seen"]) == (y["epoch"], y["seen"]), label
            assert x["accuracy"] == pytest.approx(y["accuracy"], abs=1 / 45), label  # one sample at most
        assert a["names"] == b["names"], label
    assert {m["seen"] for m in ref["metrics"]} == {45}  # duplicates of the padded last batch dropped


DROP_IN = HERE / "drop_in_rules.py"


def _drop_in_run(tmp: Path, path: Path, label: str, config: str | None, *extra: str,
                 env: dict[str, str] | None = None) -> dict:
    return _run(path, tmp, label, config, "--output_dir", str(tmp / f"{label}_ckpt"), *extra,
                reference=path == DROP_IN, env=env)


@pytest.fixture(scope="module")
def drop_in(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Accelerate's straight and resumed runs of drop_in_rules.py, and the script swapped."""
    tmp = tmp_path_factory.mktemp("drop_in")
    ref = _drop_in_run(tmp, DROP_IN, "acc", None)
    ref_resumed = _drop_in_run(tmp, DROP_IN, "acc_resumed", None, "--resume_from_checkpoint",
                               str(tmp / "acc_ckpt" / "e1_b5_s8"))
    return {"tmp": tmp, "ours": _swapped("drop_in_rules.py", tmp), "ref": ref, "ref_resumed": ref_resumed}


def test_drop_in_rules_script_gives_accelerates_numbers(drop_in: dict[str, Any]) -> None:
    """drop_in_rules.py (find_executable_batch_size, an early `break`, predictions gathered after
    the loop, sync_each_batch, save_state + load_state + skip_first_batches) under Accelerate and
    under ddp and zero3: a re-prepare after free_memory keeps the launched strategy; a pass left
    with `break` leaves the shuffle generator where Accelerate's lazy iteration does (later
    epochs' orders equal); after a loop ends, gradient_state is no longer at its end and a gather
    keeps every item; every micro-step's gradients are already the same on every process; and a
    run resumed mid-epoch (ddp checkpoint into zero3) equals Accelerate's resumed run."""
    tmp, ours, ref, ref_resumed = drop_in["tmp"], drop_in["ours"], drop_in["ref"], drop_in["ref_resumed"]
    got = {s: _drop_in_run(tmp, ours, s, f"strategy: {s}\n") for s in ("ddp", "zero3")}
    got["zero3_resumed"] = _drop_in_run(tmp, ours, "zero3_resumed", "strategy: zero3\n",
                                        "--resume_from_checkpoint", str(tmp / "ddp_ckpt" / "e1_b5_s8"))
    assert ref["tried"] == [9, 8] and ref["gathered"] == [48, 48, 48] and ref["end_after_loop"] == [False] * 3
    assert ref_resumed["losses"][0][0] == 9 and len(ref_resumed["losses"]) == len(ref["losses"]) - 8
    for label in ("ddp", "zero3", "zero3_resumed"):
        check_drop_in(drop_in, label, got[label])


def test_planted_loader_end_sticky_is_caught(drop_in: dict[str, Any]) -> None:
    """`loader_end_sticky`: gradient_state stays at its loader's end after the loop; the check
    wants Accelerate's False after each loop (and its gathered counts)."""
    from planted import caught, fault_env

    got = _drop_in_run(drop_in["tmp"], drop_in["ours"], "planted", "strategy: zero3\n",
                       env=fault_env("loader_end_sticky"))
    caught(check_drop_in, drop_in, "zero3", got, must=r"\('zero3', 'end_after_loop'\)")


def check_drop_in(runs: dict[str, Any], label: str, a: dict) -> None:
    """One run of the swapped script against Accelerate's (its resumed run for a resumed one)."""
    tol = 1e-5 if label == "ddp" else 1e-4
    b = runs["ref_resumed"] if label.endswith("resumed") else runs["ref"]
    assert a["types"] == ["MULTI_CPU" if label == "ddp" else "FSDP"] * 2, label  # not re-planned
    for key in ("tried", "end_after_loop", "gathered"):
        assert a[key] == b[key], (label, key)
    assert [s for s, _ in a["losses"]] == [s for s, _ in b["losses"]], label
    for key, flat in (("losses", lambda r: [x for _, xs in r["losses"] for x in xs]),
                      ("grads", lambda r: [x for xs in r["grads"] for x in xs])):
        assert flat(a) == pytest.approx(flat(b), rel=tol), (label, key)
    assert all(len(set(xs)) == 1 for xs in a["grads"]), label  # synced off the boundary too
    assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1 / 48), label


# -- the harness's own verdicts, with faults planted (tests/planted.py) --------------------------
def test_a_run_that_hangs_at_the_end_fails(tmp_path: Path) -> None:
    """Planted `hang_in_end_training`: shardwise's `end_training` never returns. The harness
    (which every test of this row uses) fails the run at its timeout rather than count it:
    only Accelerate's own reference run may be stopped after complete results."""
    from planted import caught, fault_env

    ours = _swapped("drop_in_rules.py", tmp_path)  # ~10 s to end_training on 2 cores
    message = caught(_run, ours, tmp_path, "hang", "strategy: ddp\n", "--output_dir", str(tmp_path / "ckpt"),
                     timeout=45, env=fault_env("hang_in_end_training"),
                     must=r"^hang: still running after 45 s \(a hang")
    assert "still running after 45 s (a hang" in message, message


def test_a_run_that_aborts_at_teardown_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Planted `abort_at_teardown`: the run writes complete results after `end_training`, then
    aborts at exit with gloo's message. The harness fails it without running it again (a retry
    into a pass would hide a teardown bug); only an abort before any results is retried, once."""
    from planted import caught, fault_env

    ours = _swapped("drop_in_rules.py", tmp_path)
    message = caught(_run, ours, tmp_path, "abort", "strategy: ddp\n", "--output_dir", str(tmp_path / "ckpt"),
                     env=fault_env("abort_at_teardown"),
                     must=r"^abort: gloo aborted after the run recorded results \(at teardown\): not retried")
    assert "gloo aborted after the run recorded results (at teardown): not retried" in message, message
    assert json.loads((tmp_path / "abort.json").read_text())["done"] is True  # it had finished its work
    out = capsys.readouterr().out
    print(out, end="")  # (the caught line, for `pytest -rA -s`)
    assert "run once more" not in out
