"""A GPU run's backend strings, on CPU: the engine's decisions read a group per device type.

On a GPU the engine's default group is `"cpu:gloo,cuda:nccl"`, and `dist.get_backend()` returns
that whole string: a comparison with "nccl" or "gloo" is never true there. A plain torchrun
script may make a pure "nccl" default group itself, which takes CUDA tensors only.
`shardwise.distributed.world.backends_of` reads a group's backend per device type, and every
decision asks it (`host_device` for the engine's host-side collectives).

- in process: the reading of each backend string a run meets, and no `get_backend` compared
  anywhere in `src/` but in `distributed/world.py` (4 branches compared the whole string);
- one spawn of 2 processes whose default group is made before the Engine as
  `"cpu:gloo,cuda:gloo"` (what a GPU run's backend checks see; gloo for CUDA too, as this CPU
  build has no NCCL): the token-weighted loss (`engine/items.py`'s agreement on N) equals one
  process; processes built with different weights agree on process 0's (`engine/session.py`);
  Accelerate's objects report the CPU's backend, "gloo" (`accelerate/objects.py`, `extras.py`);
  a zero3 backward reduce-scatters with shardwise's gloo all-reduce and hybrid sharding sums
  across replicas (`strategies/fsdp.py`'s gloo branches: FSDP2's own reduce-scatter and AVG
  before), with the collective auditor (tests/audit.py) on;
- one spawn of 2 processes whose default group reads as a pure "nccl" one (gloo underneath,
  `dist.get_backend` answering "nccl"): a CPU Engine on it is refused in one line; before, its
  host collectives sent CPU tensors on it (the auditor's finding under the planted fault).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest
import test_token_loss as TL
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn

WORLD = 2
SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"


def test_backend_strings_are_read_per_device_type() -> None:
    from shardwise.distributed.world import parse_backend

    assert parse_backend("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend("cpu:gloo,cuda:gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert parse_backend("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert parse_backend("nccl") == {"cuda": "nccl"}  # no CPU tensors on a pure NCCL group
    assert parse_backend("NCCL") == {"cuda": "nccl"}


def test_the_auditor_holds_nccls_rules() -> None:
    """tests/audit.py's rules on each backend string a run meets (one line each, naming the rule)."""
    import audit

    cpu, meta, cuda = torch.ones(2), torch.ones(2, device="meta"), torch.device("cuda", 1)
    for backend in ("gloo", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"):
        audit.check_call("all_reduce", backend, [cpu], cuda)  # host tensors on a group with a CPU backend
        audit.check_call("all_gather_object", backend, [], cuda)
    refused = {  # (a meta tensor stands for another device: this build has no CUDA tensors)
        ("all_reduce", "nccl", (cpu,)): "CPU tensors only on groups with a CPU backend: all_reduce on a",
        ("all_gather", "gloo", (cpu, meta)): "no call mixing devices: all_gather on a 'gloo' group",
        ("broadcast_object_list", "nccl", ()): "object collectives only on gloo: broadcast_object_list",
        ("broadcast", "cpu:gloo,cuda:nccl", (meta,)): "META tensors only on groups with a META backend",
        ("all_reduce", "cpu:gloo,meta:gloo", (meta,)): "training collectives on the run's device (cuda:1)",
    }
    for (name, backend, tensors), rule in refused.items():
        with pytest.raises(audit.Violation, match=re.escape(f"collective auditor: {rule}")) as err:
            audit.check_call(name, backend, list(tensors), cuda)
        assert "\n" not in str(err.value)


def test_no_backend_string_compared_outside_world() -> None:
    """`dist.get_backend(...)` read anywhere but `distributed/world.py` is a branch on a whole
    backend string (dead under "cpu:gloo,cuda:nccl"): ask `backends_of` / `host_device`."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == "distributed/world.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("get_backend"):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "read a group's backend per device type (world.backends_of):\n" + "\n".join(found)


def _make_default_group(backend: str) -> None:
    """The default group made by the test's own script, before any Engine (which reuses it)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _backward_collectives(kw: dict[str, Any]) -> list[str]:
    """The collectives one backward calls under `kw` (an all-reduce named with its op)."""
    import torch.distributed as dist

    import shardwise

    engine = shardwise.Engine(cpu=True, seed=W.SEED, **kw)
    model = W.build("tiny")
    model, _ = engine.prepare(model, W.make_optimizer(model))
    rank = dist.get_rank()
    loss = W.lm_loss(model, W.Tokens(8).data[rank * 2: rank * 2 + 2])  # (the boundary's agreement first)
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def record(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
            calls.append(f"{name} {op}" if name == "all_reduce" else name)
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, record(name))
    try:
        engine.backward(loss)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    engine.free_memory()
    return calls


def _agreed_weights() -> dict[str, torch.Tensor]:
    """A model built with other weights on each process (no seed), prepared under ddp: the
    weights it trains from."""
    import torch.distributed as dist

    import shardwise

    engine = shardwise.Engine(cpu=True, strategy="ddp")
    model = W.build("tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank())  # process 0 keeps W.build's weights
    model = engine.prepare(model)
    out = {k: v.detach().clone() for k, v in engine.unwrap_model(model).state_dict().items()}
    engine.free_memory()
    return out


def _accelerate_backends() -> tuple[Any, Any]:
    """The backend Accelerate's objects report (`accelerator.state.backend`, and the one
    `PartialState` reads, which Accelerate's own gather compares with "gloo")."""
    import types

    import torch.distributed as dist

    from shardwise.accelerate import extras
    from shardwise.accelerate.objects import AcceleratorState

    cpu = torch.device("cpu")
    state = AcceleratorState(types.SimpleNamespace(device=cpu))
    rank = dist.get_rank()
    extras.share_process_state(cpu, "MULTI_CPU", dist.get_world_size(), rank, rank)
    return state.backend, extras._partial_state_shared_dict().get("backend")


def _under_gpu_group() -> dict[str, Any]:
    """Every check's results under the default group a GPU run's checks see."""
    import torch.distributed as dist

    from shardwise.distributed.world import backends_of, host_device

    _make_default_group("cpu:gloo,cuda:gloo")
    return {
        "backend": str(dist.get_backend()),
        "read": (backends_of(), str(host_device(torch.device("cpu")))),
        "accelerate": _accelerate_backends(),
        "token": TL.train("tiny", {"strategy": "zero3"}),
        "agreed": _agreed_weights(),
        "zero3": _backward_collectives({"strategy": "zero3"}),
        "hybrid": _backward_collectives({"strategy": "zero3", "shard_group_size": 1}),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_under_gpu_group, WORLD)


def test_the_group_reads_as_a_gpu_runs(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        assert run["backend"] == "cpu:gloo,cuda:gloo"  # what a backend check sees on a GPU
        assert run["read"] == ({"cpu": "gloo", "cuda": "gloo"}, "cpu")


def test_accelerate_reports_the_backend_of_the_runs_device(runs: list[dict[str, Any]]) -> None:
    """Accelerate names one backend, its device's ("nccl" on a GPU run; its gather compares it with
    "gloo"), never the group's whole string."""
    for run in runs:
        assert run["accelerate"] == ("gloo", "gloo"), run["accelerate"]


def test_token_weighted_loss_under_a_gpu_runs_group(runs: list[dict[str, Any]]) -> None:
    TL.check_weighted(runs[0]["token"], TL.reference("tiny"), ("tiny", {"strategy": "zero3"}))


def test_weights_agree_under_a_gpu_runs_group(runs: list[dict[str, Any]]) -> None:
    built = W.build("tiny").state_dict()
    for rank, run in enumerate(runs):
        assert W.max_diff(run["agreed"], built) == 0, f"rank {rank}: not process 0's weights"


def check_gloo_branches(runs: list[dict[str, Any]]) -> None:
    """Under a group whose every backend is gloo, the engine's gloo branches are taken: a zero3
    backward reduce-scatters with an all-reduce (SUM), and hybrid sharding sums (no AVG)."""
    for rank, run in enumerate(runs):
        zero3, hybrid = run["zero3"], run["hybrid"]
        assert "reduce_scatter_single" not in zero3, \
            f"rank {rank}: zero3 reduce-scatters with FSDP2's own on gloo ({zero3})"
        assert any(c.startswith("all_reduce") for c in zero3), f"rank {rank}: {zero3}"
        averaged = [c for c in hybrid if "AVG" in c]
        assert not averaged, f"rank {rank}: hybrid sharding averages across replicas with {averaged} on gloo"


def test_gloo_branches_under_a_gpu_runs_group(runs: list[dict[str, Any]]) -> None:
    check_gloo_branches(runs)


def test_planted_backend_string_as_name_is_caught() -> None:
    """`backend_string_as_name`: the group's whole string compared with "gloo", as before."""
    results = spawn(planted(_under_gpu_group, "backend_string_as_name"), WORLD)
    caught(check_gloo_branches, results, must=r"zero3 reduce-scatters with FSDP2's own on gloo")


def _on_a_nccl_group() -> str:
    """A CPU Engine on a default group that reads as pure NCCL (gloo underneath): its refusal,
    or what the collective auditor raised at its first host collective."""
    import torch.distributed as dist

    import shardwise

    _make_default_group("gloo")
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group in (None, dist.group.WORLD) else real(group)
    try:
        engine = shardwise.Engine(cpu=True, strategy="ddp")
        model = engine.prepare(W.build("tiny"))
        engine.free_memory()
        return f"accepted ({type(model).__name__})"
    except Exception as err:  # noqa: BLE001 -- the refusal, or the auditor's violation
        return f"{type(err).__name__}: {err}"
    finally:
        dist.get_backend = real


def check_refused(lines: list[str]) -> None:
    for line in lines:
        assert line.startswith("RuntimeError: the process group made before the Engine runs on backend "
                               "'nccl', which takes no cpu tensors"), line
        assert "\n" not in line


def test_a_cpu_run_on_a_nccl_group_is_refused() -> None:
    check_refused(spawn(_on_a_nccl_group, WORLD))


def test_planted_host_tensors_on_nccl_is_caught() -> None:
    """`host_tensors_on_nccl`: the engine reads a pure-NCCL group as taking CPU tensors (no
    refusal, host collectives on the CPU): the auditor raises at the first one."""
    caught(check_refused, spawn(planted(_on_a_nccl_group, "host_tensors_on_nccl"), WORLD),
           must=r"collective auditor: CPU tensors only on groups with a CPU backend: \w+ on a 'nccl' group")
