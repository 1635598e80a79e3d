"""What a cluster scheduler tells `shardwise launch`: SLURM, a Kubernetes PyTorchJob, torchrun's
own `PET_*` variables. Pure: `detect(environ)` reads a mapping and returns what it found, each
value with the variable it came from, so it is tested in process (tests/unit/test_unit_scheduler.py).

SLURM (one `shardwise launch` per node: `srun --ntasks-per-node=1 shardwise launch train.py`):
  nodes            SLURM_STEP_NUM_NODES, SLURM_NNODES, SLURM_JOB_NUM_NODES (the first set)
  node rank        SLURM_NODEID (and with it torchrun's static rendezvous, which keeps the node
                   rank: node 0 holds global rank 0; c10d would number nodes by host name and pid)
  rendezvous host  MASTER_ADDR if set, else the first host of SLURM_STEP_NODELIST,
                   SLURM_JOB_NODELIST or SLURM_NODELIST (hostlist syntax: `gpu[01-04,07]`)
  port             MASTER_PORT if set, else 20000 + SLURM_JOB_ID % 10000 (below Linux's ephemeral
                   ports; two jobs sharing a first node get different ports unless their ids
                   differ by a multiple of 10000)
  rendezvous id    slurm-<SLURM_JOB_ID>
  processes/node   the GPUs SLURM gave: SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE (`4`, `a100:4`),
                   CUDA_VISIBLE_DEVICES; with none, the CPUs it gave the task: SLURM_CPUS_PER_TASK,
                   SLURM_CPUS_ON_NODE (one CPU process each: meant for small CPU jobs; set
                   launch.num_processes for anything else)
Kubernetes PyTorchJob (the Kubeflow training operator) and torchrun's PET_* variables:
  nodes            PET_NNODES, else WORLD_SIZE / PET_NPROC_PER_NODE (WORLD_SIZE counts processes:
                   pods x nprocPerNode)
  node rank        PET_NODE_RANK, else RANK (the pod's index: master 0, worker i is i + 1), kept
                   through the static rendezvous as for SLURM
  rendezvous       PET_MASTER_ADDR / PET_MASTER_PORT, else MASTER_ADDR / MASTER_PORT
  processes/node   PET_NPROC_PER_NODE when it is a number
The bare MASTER_ADDR / WORLD_SIZE / RANK form counts only inside a pod (KUBERNETES_SERVICE_HOST)
and never inside a torchrun worker (LOCAL_RANK, TORCHELASTIC_RUN_ID): the names are generic.
SHARDWISE_SCHEDULER=none turns detection off.

What the user gives (a flag, the config file) wins over every value here (`derive`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config.tree import ConfigError

__all__ = ["Found", "Scheduler", "derive", "detect", "expand_hostlist", "slurm_script"]

OFF_ENV = "SHARDWISE_SCHEDULER"
SLURM_PORT_BASE = 20000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


# -- SLURM's hostlist syntax -------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets ('a1,b[2-3]' -> ['a1', 'b[2-3]'])."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"a '[' inside brackets at character {i + 1}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"a ']' without its '[' at character {i + 1}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' that is never closed")
    parts.append(text[start:])
    return parts


def _numbers(spec: str) -> list[str]:
    """The inside of one pair of brackets ('01-03,07') as its numbers, zero padding kept."""
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"[{spec}]: {item!r} is not a number or a range like 01-04")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"[{spec}]: the range {item} runs backwards")
        width = len(lo) if lo.startswith("0") else 0  # 'gpu[01-10]' pads to two digits, 'n[1-10]' not
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(name: str) -> list[str]:
    """One host pattern ('rack[1-2]-n[01-02]'): every bracket group multiplies out, in order."""
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[: m.start()], name[m.end():]
    return [head + n + rest for n in _numbers(m.group(1)) for rest in _expand_one(tail)]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compact host list as host names, in SLURM's order: 'gpu[01-03,07]' ->
    gpu01 gpu02 gpu03 gpu07; 'a1,b[2-3]' -> a1 b2 b3. ValueError saying what is wrong."""
    text = text.strip()
    if not text:
        raise ValueError("it is empty")
    hosts: list[str] = []
    for part in _split_top(text):
        if not part.strip():
            raise ValueError("an empty host name between commas")
        hosts += _expand_one(part.strip())
    return hosts


# -- what was found ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Found:
    """One launch setting a scheduler gave: the LaunchConfig field, its value, where it came from."""

    field: str
    value: int | str
    source: str
    error: str = ""
    """the variable's value is malformed: this line is raised if the value is needed (no flag or
    config file gives the field)"""


@dataclass(frozen=True, slots=True)
class Scheduler:
    """A scheduler's environment, read: its name, the job, and the launch settings it gives."""

    name: str
    """SLURM, Kubernetes, or torchrun (PET_* variables)"""
    job: str
    """the job as the scheduler names it ('job 1234, restart 0'; '' when it has no id)"""
    found: tuple[Found, ...]
    """the launch settings derived, each with its source"""
    requeue_id: str | None = None
    """the SLURM job id `scontrol requeue` takes after a preempted stop (None: not SLURM)"""

    def settings(self) -> dict[str, Any]:
        """The launch section's values (field -> value; a malformed one raises its ConfigError)."""
        for f in self.found:
            if f.error:
                raise ConfigError(f.error)
        return {f.field: f.value for f in self.found}

    def describe(self, used: Iterable[str] | None = None) -> str:
        """'SLURM job 7: nodes 2 (SLURM_NNODES), ...'; a value not in `used` is marked as overridden."""
        keep = set(used) if used is not None else {f.field for f in self.found}
        parts = [f"{_WORDS[f.field]} {f.value} ({f.source}{'' if f.field in keep else '; yours wins'})"
                 if not f.error else f"{_WORDS[f.field]}: error: {f.error}" for f in self.found]
        head = f"{self.name} {self.job}".strip()
        return f"{head}: {', '.join(parts)}" if parts else f"{head}: nothing derived"


_WORDS = {"num_nodes": "nodes", "node_rank": "node rank", "main_address": "rendezvous host",
          "main_port": "port", "rdzv_id": "rendezvous id", "num_processes": "processes per node",
          "rdzv_backend": "rendezvous"}


def _bad(name: str, value: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"{name}={value!r}: {why}; {fix}")


def _count(env: Mapping[str, str], name: str, *, least: int = 1, fix: str = "") -> int | None:
    """The whole number in variable `name` (None when unset or empty); one-line error if malformed."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, "not a whole number", fix or f"fix or unset {name}") from None
    if value < least:
        raise _bad(name, raw, f"must be at least {least}", fix or f"fix or unset {name}")
    return value


def _guarded(field: str, source: str, read: Callable[[], Found | None]) -> Found | None:
    """`read()`, or a Found carrying its error: a value a flag can replace fails only if needed."""
    try:
        return read()
    except ConfigError as err:
        return Found(field, "", source, error=str(err))


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((n for n in names if env.get(n, "").strip()), None)


# -- SLURM ---------------------------------------------------------------------------------------
def _slurm_gpus(env: Mapping[str, str]) -> tuple[int, str] | None:
    """The GPUs SLURM gave this node's task, and the variable that says so."""
    on_node = _count(env, "SLURM_GPUS_ON_NODE", least=0)
    if on_node:
        return on_node, "SLURM_GPUS_ON_NODE"
    per_node = env.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:  # '4', 'a100:4', 'a100:2,v100:1'
        try:
            total = sum(int(item.rsplit(":", 1)[-1]) for item in per_node.split(","))
        except ValueError:
            raise _bad("SLURM_GPUS_PER_NODE", per_node, "not a GPU count like 4 or a100:4",
                       "fix it, or give --nproc-per-node") from None
        if total:
            return total, "SLURM_GPUS_PER_NODE"
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    devices = [d for d in visible.split(",") if d.strip() and d.strip() != "NoDevFiles"]
    return (len(devices), "CUDA_VISIBLE_DEVICES") if devices else None


def _slurm_processes(env: Mapping[str, str]) -> Found | None:
    gpus = _slurm_gpus(env)
    if gpus is not None:
        return Found("num_processes", gpus[0], gpus[1])
    name = _first(env, "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE")
    if name is None:
        return None
    cpus = _count(env, name, fix="fix it, or give --nproc-per-node")
    return Found("num_processes", cpus or 1, name)


def _slurm_tasks_check(env: Mapping[str, str], nodes: int, nodes_from: str) -> None:
    """One launcher per node, inside a job step: else the run would hang or start twice."""
    in_step = bool(_first(env, "SLURM_STEP_ID", "SLURM_STEPID"))
    if nodes > 1 and not in_step:
        raise ConfigError(
            f"{nodes_from}={nodes}: a SLURM job of {nodes} nodes, but this is not a job step (no "
            "SLURM_STEP_ID): start one launcher per node with `srun --ntasks-per-node=1 shardwise launch "
            "...` (or set SHARDWISE_SCHEDULER=none to ignore SLURM)")
    tasks = _count(env, "SLURM_STEP_NUM_TASKS") if in_step else None
    if tasks is not None and tasks != nodes:
        raise ConfigError(
            f"SLURM_STEP_NUM_TASKS={tasks} on {nodes_from}={nodes}: srun started {tasks} task(s) on "
            f"{nodes} node(s); shardwise launch starts a node's processes itself: run it as one task "
            "per node (srun --ntasks-per-node=1)")


def _slurm(env: Mapping[str, str]) -> Scheduler:
    job = env["SLURM_JOB_ID"].strip()
    job_id = _count(env, "SLURM_JOB_ID", least=0, fix="it is set by SLURM: unset it outside a job")
    found: list[Found] = []
    nodes_from = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodes = _count(env, nodes_from) if nodes_from else None
    if nodes is not None and nodes_from is not None:
        _slurm_tasks_check(env, nodes, nodes_from)
        found.append(Found("num_nodes", nodes, nodes_from))
    if nodes is not None and nodes > 1:
        found += _slurm_rendezvous(env, nodes, job_id or 0)
    processes = _guarded("num_processes", "SLURM", lambda: _slurm_processes(env))
    if processes is not None:
        found.append(processes)
    restart = env.get("SLURM_RESTART_COUNT", "").strip()
    label = f"job {job}" + (f" (restart {restart})" if restart and restart != "0" else "")
    return Scheduler("SLURM", label, tuple(found), requeue_id=job)


def _slurm_rendezvous(env: Mapping[str, str], nodes: int, job_id: int) -> list[Found]:
    found: list[Found] = []
    if "SLURM_NODEID" in env:
        rank = _count(env, "SLURM_NODEID", least=0)
        if rank is not None and rank >= nodes:
            raise _bad("SLURM_NODEID", str(rank), f"not below the {nodes} nodes of the job",
                       "run under srun, one task per node")
        if rank is not None:
            found.append(Found("node_rank", rank, "SLURM_NODEID"))
    host = _guarded("main_address", "SLURM", lambda: _slurm_host(env))
    if host is not None:
        found.append(host)
    port = _guarded("main_port", "MASTER_PORT",
                    lambda: _found("main_port", _count(env, "MASTER_PORT", fix="fix it, or give --main-port"),
                                   "MASTER_PORT"))
    found.append(port or Found("main_port", SLURM_PORT_BASE + job_id % 10000, "SLURM_JOB_ID"))
    found.append(Found("rdzv_id", f"slurm-{job_id}", "SLURM_JOB_ID"))
    if "SLURM_NODEID" in env:
        # c10d numbers nodes by their descriptors (host name, pid), not the rank given: the static
        # rendezvous keeps it, so node 0 holds global rank 0 (its lines, report and files)
        found.append(Found("rdzv_backend", "static", "SLURM_NODEID: node rank kept"))
    return found


def _found(field: str, value: int | str | None, source: str) -> Found | None:
    return None if value is None else Found(field, value, source)


def _slurm_host(env: Mapping[str, str]) -> Found | None:
    """MASTER_ADDR when set, else the first host of the step's (or job's) host list."""
    if env.get("MASTER_ADDR", "").strip():
        return Found("main_address", env["MASTER_ADDR"].strip(), "MASTER_ADDR")
    listed = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if listed is None:
        return None
    try:
        host = expand_hostlist(env[listed])[0]
    except ValueError as err:
        raise _bad(listed, env[listed], f"not a SLURM host list ({err})", "fix it, or give --main-address") \
            from None
    return Found("main_address", host, f"{listed}, first host")


# -- Kubernetes PyTorchJob, torchrun's PET_* -----------------------------------------------------
def _pet(env: Mapping[str, str]) -> Scheduler | None:
    in_pod = bool(env.get("KUBERNETES_SERVICE_HOST"))
    in_worker = "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env  # torchrun's own worker
    generic = in_pod and not in_worker  # MASTER_ADDR, WORLD_SIZE, RANK, MASTER_PORT mean the job's
    pet = any(env.get(n, "").strip() for n in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR"))
    if not (pet or (generic and env.get("MASTER_ADDR", "").strip() and env.get("WORLD_SIZE", "").strip())):
        return None
    found: list[Found] = []
    raw_nproc = env.get("PET_NPROC_PER_NODE", "").strip()
    # 'auto', 'gpu', 'cpu': torchrun's words, left to the config
    nproc = _count(env, "PET_NPROC_PER_NODE") if raw_nproc.isdigit() else None
    nodes = _pet_nodes(env, nproc, generic)
    if nodes is not None:
        found.append(nodes)
    rank_from = _first(env, "PET_NODE_RANK", *(("RANK",) if generic else ()))
    if rank_from is not None:
        found.append(Found("node_rank", _count(env, rank_from, least=0) or 0, rank_from))
    addr_from = _first(env, "PET_MASTER_ADDR", *(("MASTER_ADDR",) if generic else ()))
    if addr_from is not None:
        found.append(Found("main_address", env[addr_from].strip(), addr_from))
    port_from = _first(env, "PET_MASTER_PORT", *(("MASTER_PORT",) if generic else ()))
    port = None if port_from is None else _guarded("main_port", port_from, lambda: _found(
        "main_port", _count(env, port_from, fix="fix it, or give --main-port"), port_from))
    if port is not None:
        found.append(port)
    if nproc is not None:
        found.append(Found("num_processes", nproc, "PET_NPROC_PER_NODE"))
    if rank_from is not None:  # the node rank kept (see _slurm_rendezvous)
        found.append(Found("rdzv_backend", "static", f"{rank_from}: node rank kept"))
    return Scheduler("Kubernetes" if in_pod else "torchrun (PET_* variables)", "", tuple(found))


def _pet_nodes(env: Mapping[str, str], nproc: int | None, generic: bool) -> Found | None:
    raw = env.get("PET_NNODES", "").strip()
    if raw:
        if ":" in raw:
            raise _bad("PET_NNODES", raw, "an elastic range; shardwise launch runs a fixed number of nodes",
                       "give one number (a PyTorchJob without elasticPolicy), or --nnodes")
        return Found("num_nodes", _count(env, "PET_NNODES") or 1, "PET_NNODES")
    world = _count(env, "WORLD_SIZE") if generic else None
    if world is None:
        return None
    per = nproc or 1
    if world % per:
        raise _bad("WORLD_SIZE", str(world), f"not a multiple of PET_NPROC_PER_NODE={per}",
                   "fix one of them, or give --nnodes")
    return Found("num_nodes", world // per, "WORLD_SIZE" + (" / PET_NPROC_PER_NODE" if nproc else ""))


# -- entry points --------------------------------------------------------------------------------
def detect(environ: Mapping[str, str]) -> Scheduler | None:
    """The scheduler `environ` (a process's environment) shows, or None; a ConfigError naming the
    variable and the fix when one of its values is malformed."""
    if environ.get(OFF_ENV, "").strip().lower() in ("none", "off", "0"):
        return None
    if environ.get("SLURM_JOB_ID", "").strip():
        return _slurm(environ)
    return _pet(environ)


def derive(scheduler: Scheduler | None, explicit: Mapping[str, Any]) -> dict[str, Any]:
    """The launch settings to add below the user's: the scheduler's values for the fields the user
    did not give (`explicit`: the launch section's fields set by a flag or the config file). The
    rendezvous fields are left out when the run is on one node (torchrun's standalone rendezvous)."""
    if scheduler is None:
        return {}
    used = [f for f in scheduler.found if f.field not in explicit]
    nodes = explicit.get("num_nodes", next((f.value for f in used if f.field == "num_nodes"), 1))
    if nodes == 1:
        used = [f for f in used if f.field not in ("node_rank", "main_address", "main_port", "rdzv_id",
                                                   "rdzv_backend")]
    return Scheduler(scheduler.name, scheduler.job, tuple(used)).settings()


# -- the SLURM template --------------------------------------------------------------------------
def slurm_script(script: str = "train.py", script_args: Iterable[str] = (), *, nodes: int = 2,
                 gpus_per_node: int = 8, cpus_per_task: int | None = None, time: str = "24:00:00",
                 job_name: str = "shardwise", signal_lead_s: int = 120, config: str | None = None) -> str:
    """An sbatch script that runs `script` on `nodes` nodes under `shardwise launch`, warned
    `signal_lead_s` before the time limit, requeued after a preempted stop (docs/clusters.md)."""
    import shlex

    resources = [f"#SBATCH --gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    if cpus_per_task or not gpus_per_node:
        resources.append(f"#SBATCH --cpus-per-task={cpus_per_task or 2}"
                         + ("" if gpus_per_node else "   # on CPU: one process per CPU"))
    words = [*(["--config", config] if config else []), script, *script_args]
    launch = " ".join(shlex.quote(a) for a in words)
    lines = [
        "#!/bin/bash",
        "# Written by `shardwise slurm-script`; what each line is for: docs/clusters.md.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1   # one `shardwise launch` per node; it starts the node's processes",
        *resources,
        f"#SBATCH --time={time}",
        f"#SBATCH --signal=TERM@{signal_lead_s}   # SIGTERM to the job step {signal_lead_s} s before the "
        "time limit: every process saves at its next step",
        "#SBATCH --requeue             # the job may be requeued: node 0's launcher does it after that save",
        "#SBATCH --open-mode=append    # a requeued job appends to the same log",
        "#SBATCH --output=%x-%j.out",
        "",
        "# Every launcher reads the nodes, its rank, the rendezvous host and port, and the processes",
        "# per node from SLURM's variables, and says in one line what it found. When the workers have",
        "# saved and exited 75 (time limit near, preemption, scancel --signal=TERM), node 0 runs",
        "# `scontrol requeue $SLURM_JOB_ID`; the requeued job runs this same script and the training",
        "# script's `engine.load_state()` resumes from the newest checkpoint.",
        f"exec srun shardwise launch {launch}",
    ]
    return "\n".join(lines) + "\n"
