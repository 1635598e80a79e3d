"""The collective auditor: NCCL's rules asserted at every collective a test worker calls, on CPU.

A CPU run's collectives all run on gloo, which takes any tensor on any group; a GPU run's run on
NCCL, which does not. So a collective the CPU suite runs every day can fail at its first GPU run.
Installed in a test worker (`install`), the auditor wraps torch.distributed's collectives (the
module's attributes, and the copies a module of shardwise bound at import, e.g.
`_all_gather_flat = dist.all_gather_single`) and checks each call against the rules a GPU run
meets, reading the group's backend string per device type as NCCL does:

- `no call mixing devices`: every tensor of one call on one device;
- `tensors only on a device its group's backend takes`: a CPU tensor only on a group with a CPU
  backend ("gloo", "cpu:gloo,cuda:nccl"), never on a pure "nccl" group (CUDA tensors only);
- `training collectives on the run's device`: a tensor on the CPU or on this process's device
  (the current CUDA device on a GPU run), never on another GPU;
- `object collectives only on gloo`: `*_object*` calls only on a group whose CPU backend is gloo
  (on NCCL they pickle through the device and synchronize it).

A violation raises at the call, one line: `collective auditor: <rule>: <collective> on a <backend>
group (<devices>)`. Each worker counts the calls it checked (`COUNTS`); spawn's workers write them
beside their results and the test process adds them up (`add`), and pytest prints the total at
the end of the session (tests/conftest.py). On by default in spawn's workers
(SHARDWISE_AUDIT_COLLECTIVES=0: off). torch's functional collectives (DTensor's redistribution,
`full_tensor`, tensor, sequence, context and expert parallelism's resharding) are audited at the
Python functions DTensor calls (`torch.distributed._functional_collectives`, counted as
`functional <name>`); a call inside a graph being compiled is left to the compiler.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ENV = "SHARDWISE_AUDIT_COLLECTIVES"
TENSOR_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_single",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
    "batch_isend_irecv", "barrier", "monitored_barrier",
)  # (not isend, irecv: P2POp takes only torch's own as its `op`; batch_isend_irecv checks each op)
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list")
FUNCTIONAL = (
    "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_reduce", "all_to_all_single", "all_to_all_single_autograd",
    "broadcast",
)  # torch.distributed._functional_collectives: what DTensor's redistribution calls
COUNTS: Counter[str] = Counter()  # this process's checked calls, by collective
TOTAL: Counter[str] = Counter()  # the test process: every worker's, added up (`add`)
_ORIGINALS: dict[str, Callable[..., Any]] = {}
_CUDA = [False]  # whether CUDA is available, read once at `install`


class Violation(RuntimeError):
    """A collective a GPU run's NCCL would refuse (or run wrongly): raised at the call."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "", "false")


def run_device() -> torch.device:
    """This process's device: the current GPU where CUDA is available (the one the engine set
    with `torch.cuda.set_device`, NCCL's; several processes may share one), else the CPU."""
    if _CUDA[0]:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def per_device(backend: str) -> dict[str, str]:
    """A group's backend string read per device type, as torch dispatches it ("cpu:gloo,cuda:nccl";
    one name alone for every device type torch says it takes). The auditor's own reading, not
    shardwise's: the check may not share the code it checks."""
    text = backend.strip().lower()
    if ":" in text:
        return dict(tuple(p.strip() for p in part.split(":", 1)) for part in text.split(",") if part.strip())
    return dict.fromkeys(dist.Backend.backend_capability.get(text, ()), text)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def check(name: str, group: Any, tensors: list[torch.Tensor], device: torch.device) -> None:
    """Raise a Violation when the call breaks a rule (see the module's docstring)."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return  # no such group (not initialised, or not a member): torch's own error follows
    check_call(name, backend, tensors, device)


def check_call(name: str, backend: str, tensors: list[torch.Tensor], device: torch.device) -> None:
    """`check` for a group whose backend string is `backend`."""
    takes = per_device(backend)
    where = f"{name} on a {backend!r} group"
    if name in OBJECT_COLLECTIVES:
        if takes.get("cpu") != "gloo":
            raise Violation(f"collective auditor: object collectives only on gloo: {where}")
        return
    devices = {t.device for t in tensors}
    shown = ", ".join(sorted(str(d) for d in devices))
    if len(devices) > 1:
        raise Violation(f"collective auditor: no call mixing devices: {where} ({shown})")
    for d in devices:
        if d.type not in takes:
            raise Violation(f"collective auditor: {d.type.upper()} tensors only on groups with a "
                            f"{d.type.upper()} backend: {where} ({shown})")
        if d.type != "cpu" and d != device:
            raise Violation(f"collective auditor: training collectives on the run's device ({device}): "
                            f"{where} ({shown})")


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def audited(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch's own message for a wrong call
        arguments = bound.arguments
        if name == "batch_isend_irecv":
            for op in arguments["p2p_op_list"]:
                check(name, op.group, [op.tensor], run_device())
        else:
            tensors = [t for key, value in arguments.items() if key != "group" for t in _tensors(value)]
            check(name, arguments.get("group"), tensors, run_device())
        COUNTS[name] += 1
        return original(*args, **kwargs)

    audited.__audited__ = original  # type: ignore[attr-defined]
    return audited


def _functional_group(group: Any, tag: str) -> Any:
    """The process group a functional collective names (a group, a mesh and its dimension, a
    group's name), as torch resolves it."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(funcol._resolve_group_name(group, tag))


def _wrap_functional(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    label = f"functional {name}"

    @functools.wraps(original)
    def audited(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # torch's own message for a wrong call
        group = _functional_group(arguments.get("group"), arguments.get("tag", ""))
        tensors = [t for key, value in arguments.items() if key not in ("group", "tag")
                   for t in _tensors(value)]
        check(label, group, tensors, run_device())
        COUNTS[label] += 1
        return original(*args, **kwargs)

    audited.__audited__ = original  # type: ignore[attr-defined]
    return audited


def install() -> None:
    """Wrap torch.distributed's collectives in this process (once), and every module-level copy a
    loaded shardwise module holds."""
    if _ORIGINALS:
        return
    _CUDA[0] = torch.cuda.is_available()
    wrapped: dict[int, Callable[..., Any]] = {}
    for name in (*TENSOR_COLLECTIVES, *OBJECT_COLLECTIVES):
        original = getattr(dist, name, None)
        if original is None:
            continue
        _ORIGINALS[name] = original
        audited = _wrap(name, original)
        setattr(dist, name, audited)
        wrapped[id(original)] = audited
    from torch.distributed import _functional_collectives as funcol

    for name in FUNCTIONAL:
        original = getattr(funcol, name, None)
        if original is None:
            continue
        _ORIGINALS[f"functional {name}"] = original
        audited = _wrap_functional(name, original)
        setattr(funcol, name, audited)
        wrapped[id(original)] = audited
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("shardwise"):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in wrapped:
                setattr(module, attr, wrapped[id(value)])


def write(folder: str | Path, rank: int) -> None:
    """This process's counts, beside its results (`{rank}.audit.json`)."""
    (Path(folder) / f"{rank}.audit.json").write_text(json.dumps(dict(COUNTS)))


def add(folder: str | Path) -> None:
    """The test process: the counts every worker of a spawn wrote, added to TOTAL."""
    for path in Path(folder).glob("*.audit.json"):
        TOTAL.update(json.loads(path.read_text()))
