"""What a cluster scheduler tells `shardwise launch`, in one process (`shardwise.cli.scheduler`):
SLURM's host lists, SLURM / Kubernetes PyTorchJob / torchrun PET_* environments read into launch
settings, the user's flags and file winning over them, one-line errors naming the variable, the
launch line built from a faked SLURM job (torchrun not started), the requeue through `scontrol`,
and the sbatch template being examples/slurm/train.sbatch."""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from shardwise import cli
from shardwise.cli.scheduler import derive, detect, expand_hostlist, slurm_script
from shardwise.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]

HOSTLISTS = [
    ("node7", ["node7"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding when the start has no leading zero
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),  # padding kept past a carry
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("a[1-2],b[05,7],c", ["a1", "a2", "b05", "b7", "c"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[3]", ["x3"]),
    ("node-1.cluster.org,node-2.cluster.org", ["node-1.cluster.org", "node-2.cluster.org"]),
]
BAD_HOSTLISTS = [("gpu[01-", "never closed"), ("gpu]1", "without its '['"), ("gpu[4-2]", "backwards"),
                 ("gpu[a-b]", "not a number"), ("a,,b", "empty host"), ("", "empty"), ("g[[1]]", "inside")]


@pytest.mark.parametrize(("text", "hosts"), HOSTLISTS)
def test_hostlist_expands_as_slurm_does(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(("text", "why"), BAD_HOSTLISTS)
def test_a_bad_hostlist_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[")):
        expand_hostlist(text)


def _slurm(**extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "PATH": "/usr/bin"}
    return {**env, **extra}


def test_slurm_job_step_gives_nodes_rank_rendezvous_and_gpus() -> None:
    found = detect(_slurm(SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="32"))
    assert found is not None and found.name == "SLURM" and found.requeue_id == "4242"
    assert found.settings() == {"num_nodes": 2, "node_rank": 1, "main_address": "gpu07", "main_port": 24242,
                                "rdzv_id": "slurm-4242", "rdzv_backend": "static", "num_processes": 4}
    line = found.describe()
    assert line.startswith("SLURM job 4242: nodes 2 (SLURM_NNODES), node rank 1 (SLURM_NODEID)"), line
    assert "rendezvous host gpu07 (SLURM_JOB_NODELIST, first host)" in line
    assert "processes per node 4 (SLURM_GPUS_ON_NODE)" in line
    # the node rank kept: torchrun's static rendezvous (c10d numbers nodes by host name and pid)
    assert "rendezvous static (SLURM_NODEID: node rank kept)" in line


@pytest.mark.parametrize(("extra", "processes", "source"), [
    ({"SLURM_GPUS_PER_NODE": "a100:2"}, 2, "SLURM_GPUS_PER_NODE"),
    ({"SLURM_GPUS_PER_NODE": "3"}, 3, "SLURM_GPUS_PER_NODE"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3, "CUDA_VISIBLE_DEVICES"),
    ({"SLURM_CPUS_ON_NODE": "16", "SLURM_CPUS_PER_TASK": "6"}, 6, "SLURM_CPUS_PER_TASK"),  # the task's
    ({"SLURM_CPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": ""}, 2, "SLURM_CPUS_ON_NODE"),  # no GPU: CPUs
])
def test_slurm_processes_per_node(extra: dict[str, str], processes: int, source: str) -> None:
    found = detect(_slurm(**extra))
    assert found is not None
    assert [(f.value, f.source) for f in found.found if f.field == "num_processes"] == [(processes, source)]


def test_slurm_one_node_needs_no_step_and_no_rendezvous() -> None:
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "2",
           "SLURM_RESTART_COUNT": "1"}
    found = detect(env)
    assert found is not None and found.settings() == {"num_nodes": 1, "num_processes": 2}
    assert found.job == "job 9 (restart 1)"
    assert derive(found, {}) == {"num_nodes": 1, "num_processes": 2}


def test_master_addr_and_port_in_a_slurm_job_are_used() -> None:
    found = detect(_slurm(MASTER_ADDR="10.0.0.5", MASTER_PORT="1234"))
    assert found is not None and (found.settings()["main_address"], found.settings()["main_port"]) == (
        "10.0.0.5", 1234)


def test_pytorchjob_pod_bare_variables() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "3", "RANK": "2"}
    found = detect(env)
    assert found is not None and found.name == "Kubernetes" and found.requeue_id is None
    assert found.settings() == {"num_nodes": 3, "node_rank": 2, "main_address": "job-master-0",
                                "main_port": 23456, "rdzv_backend": "static"}


def test_pytorchjob_with_nproc_per_node_counts_pods_not_processes() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "8", "RANK": "1", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1"}
    found = detect(env)
    assert found is not None
    assert found.settings() == {"num_nodes": 2, "node_rank": 1, "main_address": "job-master-0",
                                "main_port": 23456, "num_processes": 4, "rdzv_backend": "static"}
    assert "nodes 2 (WORLD_SIZE / PET_NPROC_PER_NODE)" in found.describe()


def test_torchrun_pet_variables_anywhere() -> None:
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "h0", "PET_MASTER_PORT": "29400",
           "PET_NPROC_PER_NODE": "auto", "WORLD_SIZE": "99", "MASTER_ADDR": "elsewhere"}
    found = detect(env)
    assert found is not None and found.name == "torchrun (PET_* variables)"
    # 'auto' is torchrun's word, left to the config; the generic names count only inside a pod
    assert found.settings() == {"num_nodes": 2, "node_rank": 0, "main_address": "h0", "main_port": 29400,
                                "rdzv_backend": "static"}


@pytest.mark.parametrize("env", [
    {},
    {"MASTER_ADDR": "x", "WORLD_SIZE": "2", "RANK": "0"},  # not in a pod: generic names mean nothing
    {"KUBERNETES_SERVICE_HOST": "h", "MASTER_ADDR": "x", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
    {"SHARDWISE_SCHEDULER": "none", "SLURM_JOB_ID": "1", "SLURM_NNODES": "2"},
])
def test_nothing_detected(env: dict[str, str]) -> None:
    assert detect(env) is None


def test_explicit_values_win_and_one_node_drops_the_rendezvous() -> None:
    found = detect(_slurm(SLURM_GPUS_ON_NODE="4"))
    assert derive(found, {"num_processes": 2, "main_port": 1}) == {
        "num_nodes": 2, "node_rank": 1, "main_address": "gpu07", "rdzv_id": "slurm-4242",
        "rdzv_backend": "static"}
    assert derive(found, {"num_nodes": 1}) == {"num_processes": 4}
    assert "port 24242 (SLURM_JOB_ID; yours wins)" in found.describe(["num_nodes"])


@pytest.mark.parametrize(("env", "names"), [
    (_slurm(SLURM_NNODES="two"), "SLURM_NNODES='two': not a whole number"),
    (_slurm(SLURM_NODEID="5"), "SLURM_NODEID='5': not below the 2 nodes"),
    (_slurm(SLURM_STEP_ID=""), "not a job step (no SLURM_STEP_ID): start one launcher per node with `srun"),
    (_slurm(SLURM_STEP_NUM_TASKS="8"), "srun started 8 task(s) on 2 node(s)"),
    ({"PET_NNODES": "1:4"}, "PET_NNODES='1:4': an elastic range"),
    ({"KUBERNETES_SERVICE_HOST": "h", "MASTER_ADDR": "m", "WORLD_SIZE": "6", "PET_NPROC_PER_NODE": "4",
      "RANK": "0"}, "WORLD_SIZE='6': not a multiple of PET_NPROC_PER_NODE=4"),
])
def test_malformed_variables_are_refused_in_one_line(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError) as err:
        found = detect(env)
        derive(found, {})
    assert names in str(err.value) and "\n" not in str(err.value)


def test_a_malformed_value_a_flag_replaces_is_no_error() -> None:
    found = detect(_slurm(SLURM_JOB_NODELIST="gpu[07-", SLURM_GPUS_PER_NODE="many"))
    with pytest.raises(ConfigError, match=r"SLURM_JOB_NODELIST='gpu\[07-': not a SLURM host list .*"
                                          r"give --main-address"):
        derive(found, {})
    given = derive(found, {"main_address": "h", "num_processes": 1})  # the user's values: no error
    assert "main_address" not in given and given["main_port"] == 24242
    assert "processes per node: error: SLURM_GPUS_PER_NODE='many'" in found.describe()


# -- the launch line, the requeue, the template -------------------------------------------------
@pytest.fixture()
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    monkeypatch.setattr("shardwise.cli.launch.run_torchrun",
                        lambda argv, path, **kw: calls.append((argv, kw)) or 0)
    for name in list(os.environ):
        generic = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "KUBERNETES_SERVICE_HOST")
        if name.startswith(("SLURM_", "PET_")) or name in generic:
            monkeypatch.delenv(name)
    return calls


def test_launch_in_a_slurm_step_builds_torchrun_from_the_job(
    started: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in _slurm(SLURM_CPUS_ON_NODE="2", SLURM_NODEID="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert cli.main(["launch", "train.py", "--lr", "1"]) == 0
    (argv, kw), = started
    assert argv == ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "gpu07",
                    "--master-port", "24242", "--max-restarts", "0", "--module", "shardwise.trainer.run",
                    "train.py", "--lr", "1"]
    assert kw["after_save"].args == ("4242",)  # node 0 requeues the job after a preempted stop
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise launch: SLURM job 4242: nodes 2 (SLURM_NNODES)")
    assert err[0].endswith("running torchrun " + " ".join(argv))
    # the file and the flags win; node 1 does not requeue
    (tmp_path / "shardwise.yaml").write_text("launch:\n  num_processes: 1\n")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert cli.main(["launch", "--main-port", "3000", "train.py"]) == 0
    argv, kw = started[1]
    assert argv[:2] == ["--nproc-per-node", "1"] and "after_save" not in kw
    assert argv[argv.index("--master-addr"):argv.index("--master-port") + 2] == [
        "--master-addr", "gpu07", "--master-port", "3000"]
    assert "processes per node 2 (SLURM_CPUS_ON_NODE; yours wins)" in capsys.readouterr().err


def test_a_malformed_variable_stops_the_launch_in_one_line(
    started: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in _slurm(SLURM_JOB_NODELIST="gpu[1-").items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert cli.main(["launch", "train.py"]) == 2 and not started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardwise: error: SLURM_JOB_NODELIST='gpu[1-'"), err


def _fake_scontrol(folder: Path, code: int) -> Path:
    tool = folder / "scontrol"
    refusal = "echo 'scontrol: error: Requested operation is presently disabled' >&2\n" if code else ""
    tool.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'scontrol.log'}\n{refusal}exit {code}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


def test_requeue_says_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.cli.launch import requeue_slurm

    monkeypatch.setenv("PATH", str(tmp_path))
    assert requeue_slurm("77", 143) == 75  # no scontrol at all
    assert "SLURM job 77 not requeued: scontrol is not on PATH; exiting 75" in capsys.readouterr().err
    _fake_scontrol(tmp_path, 0)
    assert requeue_slurm("77", 143) == 143
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
    assert "requeued SLURM job 77 (scontrol requeue 77)" in capsys.readouterr().err
    _fake_scontrol(tmp_path, 1)
    assert requeue_slurm("77", 143) == 75
    assert ("scontrol requeue 77 failed with exit code 1: scontrol: error: Requested operation is presently "
            "disabled; exiting 75") in capsys.readouterr().err


def test_the_launcher_ignores_stop_signals_once_its_status_is_decided() -> None:
    import subprocess

    code = ("import os, signal, sys; from shardwise.cli.launch import ignore_stop_signals; "
            "signal.signal(signal.SIGTERM, lambda *a: None); ignore_stop_signals(); "
            "os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGINT); sys.exit(143)")
    done = subprocess.run([sys.executable, "-c", code], check=False, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM


def test_slurm_script_is_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["slurm-script"]) == 0  # examples/slurm/train.sbatch is this command's output
    text = capsys.readouterr().out
    assert text == (ROOT / "examples" / "slurm" / "train.sbatch").read_text()
    for line in ("#SBATCH --ntasks-per-node=1", "#SBATCH --signal=TERM@120", "#SBATCH --requeue",
                 "exec srun shardwise launch train.py\n"):
        assert line in text, line
    assert cli.main(["slurm-script", "--config", "run.yaml", "fit.py", "--lr", "1e-4"]) == 0
    assert "exec srun shardwise launch --config run.yaml fit.py --lr 1e-4\n" in capsys.readouterr().out
    cpu = slurm_script("t.py", nodes=1, gpus_per_node=0, cpus_per_task=4, signal_lead_s=300)
    assert "--gpus-per-node" not in cpu and "#SBATCH --cpus-per-task=4" in cpu and "TERM@300" in cpu
