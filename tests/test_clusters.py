"""Clusters as people have them, faked on this machine: `shardwise launch` started with nothing
but a scheduler's environment and the script (the config file holds no launch section).

- SLURM, two `srun`-like launches (node ranks 0 and 1, 2 processes each from SLURM_CPUS_ON_NODE,
  the rendezvous at the first host of SLURM_JOB_NODELIST, `localhost`, on the port the job id
  gives), and a Kubernetes PyTorchJob's pods the same way (MASTER_ADDR / MASTER_PORT / WORLD_SIZE /
  RANK / PET_NPROC_PER_NODE): both launchers exit 0, each says in one line what it found and
  runs, and the run equals one process on the same global batches (tests/test_multinode.py is
  the script and `check_run` the check: losses 1e-5, clipped gradient norms 1e-5 relative with
  every step clipped, weights 2e-5).
- A SLURM job preempted: SIGTERM to the launcher and every worker at once; the workers save and
  exit 75, node 0's launcher runs `scontrol requeue <job>` (a fake on PATH records it) and says
  so; no `.shardwise.lock` is left. The requeued job, the same environment on another host name
  (UTS and mount namespaces of its own, made with `unshare`: required, the test fails without
  it; the host name the job ran under is recorded and asserted to differ from this machine's),
  resumes from the step it saved and ends bit-identical to an uninterrupted run of the same job
  (tests/scripts/resilient.py); no lock is left after either.
Retries: the two-launcher runs once more only after a gloo abort while starting
(`spawn.launch_twice_at_most`, said); the job's launches go through `spawn.run_command` (its one
retry said too).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import workloads as W
import yaml
from planted import caught, fault_env
from spawn import free_port, launch_twice_at_most, run_command, wait_for_launchers

HERE = Path(__file__).resolve().parent
MULTINODE = HERE / "test_multinode.py"
RESILIENT = HERE / "scripts" / "resilient.py"
sys.path.insert(0, str(RESILIENT.parent))
from resilient import read_losses  # noqa: E402
from test_multinode import NODE_TAG, RUN, check_run  # noqa: E402

LAUNCH_TIMEOUT_S = 300
SCHEDULER_NAMES = ("SLURM_", "PET_", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                   "KUBERNETES_", "TORCHELASTIC_", "CUDA_VISIBLE_DEVICES", "SHARDWISE_")


def _base_env(**extra: str) -> dict[str, str]:
    """This machine's environment without any scheduler's or launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCHEDULER_NAMES)}
    return {**env, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **extra}


def _slurm_job_id(after: int | None = None) -> int:
    """A job id whose rendezvous port (20000 + id % 10000) is free here (`after`: above that one)."""
    first = 4100 + os.getpid() % 5000 if after is None else after + 1
    for job in range(first, first + 10000):
        with socket.socket() as s:
            try:
                s.bind(("", 20000 + job % 10000))
            except OSError:
                continue
        return job
    raise AssertionError("no free port in 20000-29999")


def _scheduler_env(kind: str, node: int, job: int, port: int) -> dict[str, str]:
    if kind == "slurm":  # what srun sets in each task of `srun --nodes 2 --ntasks-per-node 1`
        return {"SLURM_JOB_ID": str(job), "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
                "SLURM_JOB_NODELIST": "localhost,node[02]", "SLURM_CPUS_ON_NODE": "2"}
    # a PyTorchJob with 2 replicas and nprocPerNode 2, as the training operator sets it for a pod
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
            "WORLD_SIZE": "4", "RANK": str(node), "PET_NPROC_PER_NODE": "2"}


def _two_nodes(kind: str, folder: Path, first: int = 0,
               fault: str | None = None) -> tuple[list[int | None], list[str]]:
    """Two launchers, each with only the scheduler's variables, the config file and the script;
    node `first`'s started 2 s before the other's (its agent first at the rendezvous, with the
    lower pid: c10d would make it global rank 0). Codes and outputs in node order."""
    (folder / "shardwise.yaml").write_text(yaml.safe_dump({
        "strategy": "zero3", "shard_group_size": "node", "grad_accum_steps": RUN["accum"], "seed": W.SEED,
        "cpu": True}))
    job, port = _slurm_job_id(), free_port()
    procs: dict[int, subprocess.Popen[str]] = {}
    for node in (first, 1 - first):
        env = _base_env(**_scheduler_env(kind, node, job, port), **{NODE_TAG: str(node)})
        env = fault_env(fault, env) if fault else env
        procs[node] = subprocess.Popen([sys.executable, "-m", "shardwise", "launch", str(MULTINODE), "--out",
                                        str(folder)], cwd=folder, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
        time.sleep(2.0 if node == first else 0.0)
    return wait_for_launchers([procs[0], procs[1]], LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("first", [0, 1], ids=["node0_first", "node1_first"])
@pytest.mark.parametrize("kind", ["slurm", "pytorchjob"])
def test_two_nodes_from_the_schedulers_variables_match_one_process(kind: str, first: int,
                                                                   tmp_path: Path) -> None:
    """Started in either order, the node rank the scheduler gives is kept: node 0 holds global
    ranks 0 and 1 (where the progress lines, the report and the main process's files are)."""
    codes, outs = launch_twice_at_most(lambda: _two_nodes(kind, tmp_path, first), f"{kind} two nodes",
                                       lambda: any(tmp_path.glob("rank*.pt")))
    check_scheduled_nodes(kind, codes, outs, tmp_path)


def test_planted_node_rank_by_arrival_is_caught(tmp_path: Path) -> None:
    """`node_rank_by_arrival`: the launcher leaves the rendezvous to c10d, which numbers the nodes
    by arrival; node 1, started first, holds global rank 0, which the check fails."""
    codes, outs = launch_twice_at_most(lambda: _two_nodes("slurm", tmp_path, 1, "node_rank_by_arrival"),
                                       "slurm two nodes", lambda: any(tmp_path.glob("rank*.pt")))
    caught(check_scheduled_nodes, "slurm", codes, outs, tmp_path,
           must=r"^global ranks 0-3 ran on nodes \[1, 1, 0, 0\]")


def check_scheduled_nodes(kind: str, codes: list[int | None], outs: list[str], tmp_path: Path) -> None:
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    nodes = [r.node for r in results]  # rank r's node
    assert nodes == [0, 0, 1, 1], f"global ranks 0-3 ran on nodes {nodes}"
    said = [next(ln for ln in o.splitlines() if ln.startswith("shardwise launch: ")) for o in outs]
    for node, line in enumerate(said):  # one line: what it found, what it runs
        if kind == "slurm":
            assert line.startswith("shardwise launch: SLURM job "), line
            assert f"nodes 2 (SLURM_STEP_NUM_NODES), node rank {node} (SLURM_NODEID), rendezvous host " \
                   "localhost (SLURM_JOB_NODELIST, first host)" in line, line
            assert "processes per node 2 (SLURM_CPUS_ON_NODE)" in line, line
        else:
            assert line.startswith("shardwise launch: Kubernetes: nodes 2 (WORLD_SIZE / PET_NPROC_PER_NODE), "
                                   f"node rank {node} (RANK), rendezvous host localhost (MASTER_ADDR)"), line
        assert f"running torchrun --nproc-per-node 2 --nnodes 2 --node-rank {node} " in line, line
        assert "rendezvous static (" in line and "node rank kept)" in line, line  # not c10d's arrival order
    assert all(r.world == 4 and r.local_world_size == 2 for r in results)
    print(f"{kind}: 2 nodes x 2 from the scheduler's variables: {check_run(results)}")


# -- preempted, requeued, resumed elsewhere --------------------------------------------------------
def _fake_scontrol(folder: Path) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'scontrol.log'}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _job_env(job: int, bin_dir: Path, fault: str = "") -> dict[str, str]:
    """One node of a SLURM job (a step of one task), its CPUs giving 2 processes; `scontrol` faked."""
    return _base_env(SLURM_JOB_ID=str(job), SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID="0",
                     SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1",
                     SLURM_JOB_NODELIST="localhost", SLURM_CPUS_ON_NODE="2",
                     PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", SHARDWISE_TEST_FAULT=fault)


def _job(folder: Path, env: dict[str, str], *,
         elsewhere: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The job's launch; `elsewhere`: on another host name, which the shell that then becomes
    the launcher writes to that file (what `hostname` says inside the namespace)."""
    cmd = [sys.executable, "-m", "shardwise", "launch", str(RESILIENT), str(folder)]
    if elsewhere is not None:
        rename = f'{_RENAME} && hostname > "{elsewhere}" && exec "$@"'
        cmd = ["unshare", "--uts", "--mount", "sh", "-c", rename, "sh", *cmd]
    return run_command(cmd, env=env, cwd=folder, timeout=LAUNCH_TIMEOUT_S)


# another host name, which resolves (torchrun's rendezvous looks its own name up): a UTS namespace,
# and a mount namespace where /etc/hosts names it
_RENAME = ('h=$(mktemp) && cat /etc/hosts > "$h" && echo "127.0.0.1 requeued-node" >> "$h" && '
           'mount --bind "$h" /etc/hosts && hostname requeued-node')


def _check_can_rename_host() -> None:
    """`unshare --uts --mount` works here (root, or user namespaces): required, not skipped; a
    requeue tested on the same host name would not show that nothing ties a run to its host."""
    assert shutil.which("unshare") is not None, "unshare (util-linux) is needed to requeue on another host"
    done = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", _RENAME + " && hostname"],
                          check=False, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "requeued-node", (done.returncode, done.stdout,
                                                                             done.stderr)


def _config(folder: Path) -> None:
    folder.mkdir()
    (folder / "shardwise.yaml").write_text(yaml.safe_dump({
        "cpu": True, "seed": W.SEED, "strategy": "zero3", "checkpoint_dir": str(folder / "checkpoints")}))


def _preempt(folder: Path, env: dict[str, str]) -> tuple[int, str]:
    """The job's launch, then SIGTERM to every process of the job step at once (SLURM's time-limit
    signal, scancel) after its third step; the launcher's exit status and its stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "launch", str(RESILIENT), str(folder)],
                            env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    losses = folder / "losses.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (losses.is_file()
                                               and len(losses.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    found = subprocess.run(["pgrep", "-f", f"{RESILIENT} {folder}"], check=False, capture_output=True,
                           text=True)
    workers = [int(pid) for pid in found.stdout.split() if int(pid) != proc.pid]
    assert len(workers) == 2, found.stdout
    for pid in [proc.pid, *workers]:
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def check_preempted(folder: Path, job: int, code: int, err: str, log: Path) -> int:
    """Stopped with its checkpoint saved, the job requeued once, the lock released; the step saved."""
    assert code == 128 + signal.SIGTERM, err[-3000:]
    steps = sorted(int(p.name.split("_")[1]) for p in (folder / "checkpoints").glob("step_*"))
    saved = steps[-1]
    assert f"stopped after step {saved} (SIGTERM) with its checkpoint saved in " in err, err[-3000:]
    assert f"shardwise launch: requeued SLURM job {job} (scontrol requeue {job})" in err, \
        f"no requeue said: {err[-3000:]}"
    assert log.is_file() and log.read_text() == f"requeue {job}\n"  # once, by node 0's launcher
    assert not (folder / "checkpoints" / ".shardwise.lock").exists()  # released by the exit 75 too
    return saved


def test_planted_requeue_skipped_is_caught(tmp_path: Path) -> None:
    """`requeue_skipped`: the launcher of a preempted SLURM job exits without `scontrol requeue`;
    the preemption check fails (the job would end there, its checkpoint never resumed)."""
    job, bin_dir = _slurm_job_id(), _fake_scontrol(tmp_path)
    _config(tmp_path / "preempted")
    env = fault_env("requeue_skipped", _job_env(job, bin_dir, "slow:0.4"))
    code, err = _preempt(tmp_path / "preempted", env)
    caught(check_preempted, tmp_path / "preempted", job, code, err, tmp_path / "scontrol.log",
           must=r"^no requeue said: ")


def test_a_preempted_slurm_job_requeues_and_resumes_elsewhere_bit_identical(tmp_path: Path) -> None:
    job = _slurm_job_id()
    bin_dir = _fake_scontrol(tmp_path)
    log = tmp_path / "scontrol.log"
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    _config(straight)
    _config(preempted)
    lock = ".shardwise.lock"

    ref = _job(straight, _job_env(job, bin_dir))  # the job uninterrupted
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert f"shardwise launch: SLURM job {job}: nodes 1 (SLURM_STEP_NUM_NODES), processes per node 2 " \
           "(SLURM_CPUS_ON_NODE); running torchrun --nproc-per-node 2 --standalone" in ref.stderr
    assert not (straight / "checkpoints" / lock).exists() and not log.exists()

    code, err = _preempt(preempted, _job_env(job, bin_dir, "slow:0.4"))
    saved = check_preempted(preempted, job, code, err, log)

    # the requeued job: the same environment and command, on another node (another host name)
    _check_can_rename_host()
    host = tmp_path / "requeued_host"
    again = _job(preempted, _job_env(job, bin_dir), elsewhere=host)
    assert again.returncode == 0, again.stderr[-3000:]
    elsewhere = host.read_text().strip()
    assert elsewhere == "requeued-node" != socket.gethostname(), (elsewhere, socket.gethostname())
    assert f"starting at step {saved}" in again.stdout, (again.stdout[-2000:], again.stderr[-3000:])
    assert "took over the run lock" not in again.stderr  # there was none to take over
    assert not (preempted / "checkpoints" / lock).exists()
    assert log.read_text() == f"requeue {job}\n"  # a run that ends normally requeues nothing
    ref_losses, ref_state = read_losses(straight), torch.load(straight / "final.pt", weights_only=True)
    got_losses, state = read_losses(preempted), torch.load(preempted / "final.pt", weights_only=True)
    print(f"preempted after step {saved}, requeued, resumed on host {elsewhere!r} (this machine: "
          f"{socket.gethostname()!r}): losses and weights bit-identical")
    assert got_losses == ref_losses  # every step, bit for bit
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)
