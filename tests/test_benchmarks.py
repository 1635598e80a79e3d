"""The GPU benchmarks' logic and their CPU dry runs (the GPU runs themselves need a GPU)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 100, 511])
def test_largest_batch_search_finds_the_boundary(limit: int) -> None:
    from gpu_capacity import largest_batch

    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= limit

    assert largest_batch(fits, 512) == limit
    assert len(tried) <= 2 * 10 + 2  # doubling plus bisection, not a linear scan


def test_largest_batch_when_nothing_fits_or_everything_does() -> None:
    from gpu_capacity import largest_batch

    assert largest_batch(lambda b: False, 64) == 0
    assert largest_batch(lambda b: True, 48) == 48


def test_gpu_capacity_dry_run_writes_one_json(tmp_path: Path) -> None:
    import gpu_capacity

    path = gpu_capacity.main(["--dry-run", "--models", "gpt2-tiny", "--budget-gb", "2",
                              "--max-batch", "16", "--timed-steps", "1", "--out", str(tmp_path)])
    data = json.loads(path.read_text())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    rows = {r["strategy"]: r for r in data["rows"]}
    assert set(rows) == {"ddp", "zero2", "zero3"}
    assert all(1 <= r["max_batch"] < 16 and r["tokens_per_s"] > 0 for r in rows.values())


def test_offload_gpu_dry_run_compares_the_same_training(tmp_path: Path) -> None:
    """The GPU offload benchmark's CPU dry run: both peers train the same model on the same batch
    (same first loss), and one JSON comes out with tokens/s for each."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "offload_gpu.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--rounds", "2", "--steps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"shardwise", "deepspeed"}
    assert rows["shardwise"]["first_loss"] == pytest.approx(rows["deepspeed"]["first_loss"], rel=1e-6)
    assert all(r["tokens_per_s"] > 0 for r in rows.values()) and rows["shardwise"]["vs_deepspeed"] > 0
    assert "x DeepSpeed" in proc.stdout


def test_host_optimizer_runs_every_way_and_reports_ratios(tmp_path: Path) -> None:
    """benchmarks/host_optimizer.py on a small size: every way steps (DeepSpeed's included), and
    the JSON holds each way's median, spread and the ratios docs/benchmarks.md quotes."""
    pytest.importorskip("deepspeed")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "host_optimizer.py"
    env = {**os.environ, "MASTER_PORT": "29631"}
    proc = subprocess.run(
        [sys.executable, str(script), "--sizes", "0.25", "--rounds", "2", "--steps", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    (size,) = json.loads(path.read_text())["results"].values()
    ways = size["ways"]
    assert set(ways) == {
        "plain", "foreach", "fused", "ds_cpu_adam", "shardwise", "shardwise_dsk", "shardwise_ds", "deepspeed"
    }
    for row in ways.values():
        lo, hi = row["spread_ms"]
        assert row["elements_per_s"] > 0 and 0 < lo <= row["ms"] <= hi
        assert row["vs_ds_cpu_adam"] > 0 and row["vs_deepspeed"] > 0
    assert ways["ds_cpu_adam"]["vs_ds_cpu_adam"] == 1.0 and "x DeepSpeedCPUAdam" in proc.stdout


def test_comm_measures_what_the_planner_computes(tmp_path: Path) -> None:
    """benchmarks/comm.py on 4 processes as 2 simulated nodes x 2, a tiny GPT: the bytes each rank
    sends within a node and across nodes per optimizer step, counted by wrapping c10d, equal
    `shardwise.plan.comm.step_comm` exactly (the model's shards need no padding), for zero2 and
    zero3, full and hybrid; full sharding sends everything across nodes, hybrid only the
    all-reduce of each rank's half of the gradients."""
    import comm

    from shardwise.plan.comm import step_comm

    path = comm.main(["--tiny", "--steps", "1", "--link-gbps", "1", "--out", str(tmp_path)])
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert set(rows) == {"zero2 full", "zero2 hybrid", "zero3 full", "zero3 hybrid"}
    for case, row in rows.items():
        strategy, mode = case.split()
        want = step_comm(strategy, row["parameters"], "fp32", world_size=4, nodes=2,
                         group_size=2 if mode == "hybrid" else None)
        assert (row["intra"], row["inter"]) == (want.intra, want.inter), case
        assert all(t > 0 for t in row["step_s"].values()) and set(row["step_s"]) == {"none", "1"}
    assert rows["zero3 full"]["intra"] == {} and rows["zero3 hybrid"]["inter"].keys() == {"all_reduce"}
    # on gloo the full-sharding reduce-scatter runs as an all-reduce: twice the bytes on the wire
    # (plus the step boundary's 16-byte all-reduce of flags)
    full = rows["zero2 full"]
    assert full["wire"]["inter"] == (full["inter"]["all_gather"] + 2 * full["inter"]["reduce_scatter"]
                                     + full["inter"]["all_reduce"])
    assert set(data["hybrid_speedup"]) == {"zero2", "zero3"}


def test_speed_features_dry_run(tmp_path: Path) -> None:
    """benchmarks/speed_features.py on a tiny GPT at 2 processes: one JSON with the three parts;
    the compiled run trains the same numbers as the eager one (last loss within 1e-4), every
    activation-checkpointing mode ran, and an asynchronous save stalls the loop less than a
    synchronous one (the copy to host memory against the whole write)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "speed_features.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         "--tiny", "--steps", "2", "--saves", "1", "--strategies", "zero3", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    results = json.loads(path.read_text())["results"]
    row = results["compile"]["zero3"]
    assert abs(row["last_loss_eager"] - row["last_loss_compiled"]) < 1e-4
    assert row["compiled_first_step_s"] > row["compiled_median_step_s"] > 0  # the first step compiles
    assert set(results["ac"]) == {"none", "full", "selective", "offload"}
    assert all(r["peak_mib"] > 0 and r["median_step_s"] > 0 for r in results["ac"].values())
    kept = {mode: r["kept_for_backward_mib"] for mode, r in results["ac"].items()}
    assert kept["full"] < kept["selective"] < kept["none"]
    assert results["async"]["async"]["stall_s"] < results["async"]["sync"]["stall_s"]


def test_step_hooks_times_every_hook_the_engine_adds(tmp_path: Path) -> None:
    """benchmarks/step_hooks.py at 2 processes, 3 steps of ddp: every hook the engine adds to a
    step is timed, each hook of the step boundary in both loops (a plain loop reaches the
    boundary at its training forward, a loop through `accumulate()` there)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "step_hooks.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         "--strategies", "ddp", "--steps", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    results = json.loads(path.read_text())["results"]
    plain, accumulate = results["ddp plain"], results["ddp accumulate"]
    hooks = {"boundary: observation", "boundary: supervision", "boundary: compile watch"}
    assert set(plain) == set(accumulate) == {"heartbeats", "step_ms_median", *hooks}
    assert all(v > 0 for v in [*accumulate.values(), *plain.values()])


def test_tensor_parallel_benchmark_measures_memory_and_collectives(tmp_path: Path) -> None:
    """benchmarks/tensor_parallel.py at 4 processes on a small Llama, 1 step: every case ran;
    per-rank parameters order as the layouts say (zero3 a quarter of ddp; tp splits only the
    planned layers, so dp2 x tp2 and tp4 hold more than zero3, less than ddp); tensor parallelism
    adds all-reduces of activations (more calls than zero3's gradient reductions); with sequence
    parallelism the same parameters and fewer bytes saved for backward."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "tensor_parallel.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script),
         "--steps", "1", "--hidden", "128", "--layers", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    results = json.loads(path.read_text())["results"]
    assert set(results) == {"ddp", "zero3", "dp2 x tp2", "dp2 x tp2 + sp", "tp4", "tp4 + sp"}
    params = {case: r["mib"]["params"] for case, r in results.items()}
    for case in ("dp2 x tp2", "tp4"):  # sequence parallelism: the same weights, fewer saved activations
        assert params[f"{case} + sp"] == params[case]
        assert results[f"{case} + sp"]["mib"]["saved"] < results[case]["mib"]["saved"]
    assert params["zero3"] < params["dp2 x tp2"] < params["tp4"] < params["ddp"]
    assert abs(params["zero3"] * 4 - params["ddp"]) < 0.05
    zero3_reductions = results["zero3"]["collective_calls"]["all_reduce"]
    assert results["tp4"]["collective_calls"]["all_reduce"] > zero3_reductions
    assert "all_gather" not in results["tp4"]["collective_calls"]  # one dp rank: nothing to gather
    assert all(r["step_s"] > 0 for r in results.values())


def test_long_context_benchmark_measures_the_split(tmp_path: Path) -> None:
    """benchmarks/long_context.py at 1 and 2 processes, 512 and 1024 tokens: every layout ran;
    tiling saves bytes in one process; cp 2 saves at most 0.6 of one tiled process's per rank at
    1024 tokens (ring and Ulysses alike); the longest length within a cap is read from them."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "long_context.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--lengths", "512", "1024", "--processes", "1", "2", "--steps", "1",
         "--cap-mib", "20", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    summary = {s["layout"]: s for s in json.loads(path.read_text())["summary"]}
    assert set(summary) == {"1 process", "1 process tiled", "2 processes ring tiled",
                            "2 processes ulysses tiled"}
    saved = {name: s["saved_mib"]["1024"] for name, s in summary.items()}
    assert saved["1 process tiled"] < saved["1 process"]
    for method in ("ring", "ulysses"):
        assert saved[f"2 processes {method} tiled"] <= 0.6 * saved["1 process tiled"], saved
    for s in summary.values():
        fits = [int(n) for n, mib in s["saved_mib"].items() if mib <= 20]
        assert s["longest_within_cap"] == max(fits, default=0)


def test_moe_benchmark_compares_expert_parallelism_with_zero3(tmp_path: Path) -> None:
    """benchmarks/moe.py at 2 processes, ep 1 and 2: ZeRO-3 alone gathers the experts (derived
    bytes) and sends nothing by all-to-all; ep 2 (= the processes) holds the same half of the
    experts, gathers none and sends tokens (measured bytes); both train (finite losses)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "moe.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--processes", "2", "--eps", "1", "2", "--steps", "1", "--hidden", "32",
         "--intermediate", "64", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    zero3, ep2 = json.loads(path.read_text())["rows"]
    assert zero3["ep"] == 1 and ep2["ep"] == 2
    assert ep2["expert_mib"] == pytest.approx(zero3["expert_mib"]) and ep2["expert_mib"] > 0
    assert zero3["gather_mib"] > 0 and zero3["a2a_mib"] == 0
    assert ep2["gather_mib"] == 0 and ep2["a2a_mib"] > 0
    assert all(math.isfinite(r["loss"]) for r in (zero3, ep2))


# -- benchmarks/gpu_session.sh: its verdict, shown on CPU -----------------------------------------
ROOT = Path(__file__).resolve().parents[1]
SESSION_STEPS = "plan cuda multi tp moe"  # each kind of part: no CPU form, skipped, run, too few GPUs


def _gpu_session(tmp_path: Path, env: dict[str, str] | None = None,
                 **limits: str) -> subprocess.CompletedProcess:
    """benchmarks/gpu_session.sh's CPU dry run (GPU_SESSION_DRY_RUN=1) of SESSION_STEPS, a fake
    `nvidia-smi` on PATH saying one H200 (the machine a session is lent), nothing to install from a
    registry (PIP_NO_INDEX); `limits`: parts' *_S variables."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H200 (fake), 143771 MiB, 0.0"\n')
    (fake / "nvidia-smi").chmod(0o755)
    base = dict(os.environ if env is None else env)
    env = {**base, "PATH": f"{fake}{os.pathsep}{base.get('PATH', '')}", "STEPS": SESSION_STEPS,
           "GPU_SESSION_DRY_RUN": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "PIP_NO_INDEX": "1", **limits}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def _verdicts(proc: subprocess.CompletedProcess) -> dict[str, tuple[str, str]]:
    """The summary's lines: part -> (PASS/FAIL/SKIP, the rest of its line)."""
    lines = proc.stdout.split("== summary", 1)[-1].splitlines()[1:]
    found = [line.split(None, 2) for line in lines if line[:4] in ("PASS", "FAIL", "SKIP")]
    return {f[1]: (f[0], f[2] if len(f) > 2 else "") for f in found}


def check_session_passes(proc: subprocess.CompletedProcess) -> None:
    """The session exits 0 and no part of its summary failed."""
    failed = [f"FAIL {part} {rest}" for part, (status, rest) in _verdicts(proc).items() if status == "FAIL"]
    assert proc.returncode == 0 and not failed, \
        f"gpu_session.sh exited {proc.returncode}: {'; '.join(failed) or proc.stderr[-2000:]}"


def test_gpu_session_says_pass_or_fail(tmp_path: Path) -> None:
    """benchmarks/gpu_session.sh on CPU (its dry run, a fake nvidia-smi): every selected part
    passes or says why it skipped, exit 0, within a minute; the same parts with one past its limit:
    that part FAILs ("timed out"), exit 1; the default limits add to at most 12 minutes."""
    import time

    t0 = time.monotonic()
    proc = _gpu_session(tmp_path)
    took = time.monotonic() - t0
    print(proc.stdout[-3000:], f"\n{took:.1f} s")
    check_session_passes(proc)
    verdicts = _verdicts(proc)
    assert list(verdicts) == SESSION_STEPS.split(), verdicts
    assert verdicts["multi"][0] == "PASS" and "2 passed" in verdicts["multi"][1], verdicts["multi"]
    assert verdicts["cuda"][0] == "SKIP" and "needs a CUDA GPU" in verdicts["cuda"][1], verdicts["cuda"]
    assert verdicts["plan"][0] == verdicts["tp"][0] == verdicts["moe"][0] == "SKIP"
    assert "1 GPU(s): it needs 4" in verdicts["tp"][1]
    assert (tmp_path / "out" / "summary.txt").read_text().count("\n") == len(verdicts)
    assert took < 60, took
    limits = re.search(r"^limits \(s\): .*; total (\d+) \(session cap (\d+)\)", proc.stdout, re.MULTILINE)
    assert limits and int(limits[1]) <= int(limits[2]) == 720, proc.stdout[:500]
    late = _gpu_session(tmp_path, MULTI_S="1")
    assert late.returncode == 1, late.stdout[-2000:]
    status, rest = _verdicts(late)["multi"]
    assert status == "FAIL" and rest.split()[1:5] == ["timed", "out", "after", "1"], (status, rest)


def test_planted_gpu_session_stage_aliases_is_caught(tmp_path: Path) -> None:
    """Every process the session starts with `gpu_session_stage_aliases` planted (an asynchronous
    save's staging aliasing the live tensors): the multi part's async check fails, and the
    session exits non-zero, naming it."""
    from planted import caught, fault_env

    proc = _gpu_session(tmp_path, fault_env("gpu_session_stage_aliases"))
    caught(check_session_passes, proc, must=r"^gpu_session.sh exited 1: FAIL multi .*failed: "
                                           r"test_async_checkpoint_resumes_bit_identical")
