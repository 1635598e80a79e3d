"""The multi-process paths on a GPU: several processes sharing one GPU (CI has none: these skip there).

tests/test_cuda.py runs worlds of one; what only several processes on a GPU run (the
asynchronous checkpoint's staging and writer thread, offloaded state through a checkpoint,
hybrid sharding, context and expert parallelism with CUDA tensors in their collectives) runs
here, every process on cuda:0. NCCL refuses two processes on one device, so each worker makes
the default group itself, `"cpu:gloo,cuda:gloo"`, before its Engine (which reuses it), with
LOCAL_RANK 0 (the engine takes the GPU of LOCAL_RANK: the only one there is). Each case against
one plain process on the same device, or a resume bit-identical to the run it came from:

- async: zero3 + AdamW at 2 processes: the GPU memory allocated while an asynchronous save is
  written grows by less than half the staged bytes (the staged copy is on the host); a resume
  from an asynchronous checkpoint written while the next step updated the weights ends
  bit-identical (losses, weights, this rank's AdamW shards) to the uninterrupted run, and the
  checkpoint's tensors equal a synchronous save of the same step.
- offload: zero3 + offload optimizer, zero3 + offload params at 2: saved at step 3, resumed to
  step 6 bit-identical; the uninterrupted run within 1e-5 (losses) / 2e-5 (weights) of one
  plain process.
- hybrid: zero3, 4 processes as 2 sharding groups of 2: losses 1e-5, norms 1e-5 rel., weights
  2e-5 of one plain process (tests/test_hybrid.py's tolerances).
- cp: context parallelism 2 (Ulysses, zero3) on the tiny Llama: losses and norms 1e-5, weights
  within tests/test_context_parallel.py's bound. The ring cannot run here (`RING_ON_GLOO`: its
  send/recv need NCCL, one GPU per process): skipped on a GPU, saying so; run on CPU processes.
- ep: expert parallelism 2 (Mixtral, zero3): losses and norms 1e-5, weights 5e-5.

A case whose collective gloo cannot run on CUDA tensors is skipped, naming the error (what
cannot run on one GPU). `SHARDWISE_CUDA_MULTI_ON_CPU=1` runs the same checks on CPU processes
(the memory check aside): `benchmarks/gpu_session.sh`'s CPU dry run does.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path
from typing import Any

import pytest
import test_checkpoint_async as CA
import test_context_parallel as CP
import test_expert_parallel as EP
import torch
import workloads as W
from spawn import spawn
from torch.utils.data import DataLoader

ON_GPU = torch.cuda.is_available()
ON_CPU = not ON_GPU and os.environ.get("SHARDWISE_CUDA_MULTI_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(
    not (ON_GPU or ON_CPU),
    reason="needs a CUDA GPU (CI has none; SHARDWISE_CUDA_MULTI_ON_CPU=1 runs the checks on CPU processes)")
DEVICE = "cuda" if ON_GPU else "cpu"
TIMEOUT = 300  # seconds a spawn may take (the whole file is ~2 minutes on an H200)
# what gloo says when it cannot run a collective on CUDA tensors (a case that meets it is skipped, named)
GLOO_CANNOT = re.compile(r"(?i)gloo.*(not supported|unsupported|no support|not implemented|only supports? cpu"
                         r"|expects? cpu)|(not supported|unsupported|no support|not implemented).*gloo"
                         r"|not (implemented|supported) for (the )?cuda")


def _start() -> None:
    """This worker's default group, on the GPU every process shares (cuda:0), before any Engine."""
    import torch.distributed as dist

    if ON_GPU:
        os.environ["LOCAL_RANK"] = "0"  # the engine takes LOCAL_RANK's GPU: the only one there is
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # (deterministic cuBLAS: a resume bit for bit)
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("cpu:gloo,cuda:gloo", timeout=datetime.timedelta(seconds=120))


def _engine(**kw: Any) -> Any:
    import shardwise

    return shardwise.Engine(cpu=not ON_GPU, seed=W.SEED, preempt_signals=(), **kw)


def _cpu(obj: Any) -> Any:
    """Tensors (in dicts, lists, dataclasses of Looped's kind) moved to the host, detached."""
    if torch.is_tensor(obj):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    if isinstance(obj, CA.Looped):
        return {"losses": obj.losses, "state": _cpu(obj.state), "optim": _cpu(obj.optim), "step": obj.step}
    return obj


def _guarded(fn: Any, *args: Any) -> Any:
    """`fn(*args)`, or {"cannot": the error} where gloo cannot run a collective on CUDA tensors."""
    try:
        return fn(*args)
    except (RuntimeError, NotImplementedError) as err:
        if ON_GPU and GLOO_CANNOT.search(str(err)):
            return {"cannot": str(err).strip().splitlines()[0][:300]}
        raise


def _ran(result: Any) -> Any:
    if isinstance(result, dict) and "cannot" in result:
        pytest.skip(f"gloo cannot run this on CUDA tensors (one GPU, several processes): {result['cannot']}")
    return result


# -- async: GPU memory during the write, contents, resume bit for bit ---------------------------
def _async(folder: str) -> dict[str, Any]:
    _start()
    return _guarded(_async_runs, Path(folder))


def _async_runs(root: Path) -> dict[str, Any]:
    engine = _engine(strategy="zero3", checkpoint_async=True, checkpoint_dir=str(root / "checkpoints"))
    CA._slow_writes(0.5)  # every write pending a while: step_3's overlaps step 4's update
    seen: dict[str, Any] = {}

    def at_step(step: int, model: Any, opt: Any) -> None:
        if step == 2:  # the write alone (nothing else allocates meanwhile): the GPU's peak over it
            if ON_GPU:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if ON_GPU else 0
            engine.save_state()  # step_2
            seen["staged"] = engine.memory_report().staging
            engine.wait_for_checkpoint()
            seen["grown"] = torch.cuda.max_memory_allocated() - before if ON_GPU else None
        if step == 3:
            engine.config.checkpointing.background = False
            engine.save_state(root / "sync_3")  # what step_3 must hold
            engine.config.checkpointing.background = True
            engine.save_state()  # step_3, written while step 4 updates the weights in place

    straight = CA._loop(engine, 6, at_step=at_step)
    engine.free_memory()  # (waits for the pending write)
    again = _engine(strategy="zero3", checkpoint_async=True, checkpoint_dir=str(root / "checkpoints"))
    resumed = CA._loop(again, 6, load=str(root / "checkpoints" / "step_3"))
    again.free_memory()
    return {"straight": _cpu(straight), "resumed": _cpu(resumed), **seen}


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    folder = tmp_path_factory.mktemp("async")
    return spawn(_async, 2, str(folder), timeout=TIMEOUT), folder


def check_async_resume(runs: list[dict[str, Any]], folder: Path) -> None:
    """A resume from step_3 (written in the background while step 4 ran) bit-identical to the
    uninterrupted run, and step_3's tensors those of a synchronous save of step 3."""
    for rank, run in enumerate(runs):
        straight, resumed = run["straight"], run["resumed"]
        assert straight["step"] == resumed["step"] == 6, (straight["step"], resumed["step"])
        assert straight["losses"][3:] == resumed["losses"], \
            f"rank {rank}: steps 4-6 resumed {resumed['losses']}, uninterrupted {straight['losses'][3:]}"
        assert CA._identical(straight["state"], resumed["state"]), f"rank {rank}: resumed weights differ"
        assert len(straight["optim"]) == len(resumed["optim"]) > 0
        assert all(CA._identical(a, b) for a, b in zip(straight["optim"], resumed["optim"])), \
            f"rank {rank}: resumed AdamW shards differ"
    sync, written = CA._all_tensors(folder / "sync_3"), CA._all_tensors(folder / "checkpoints" / "step_3")
    assert len(sync) > 20 and CA._identical(sync, written), \
        "step_3 (written in the background) differs from a synchronous save of step 3"


def test_async_checkpoint_resumes_bit_identical(async_runs: tuple[list[Any], Path]) -> None:
    runs, folder = async_runs
    check_async_resume([_ran(run) for run in runs], folder)


def test_async_write_keeps_its_copy_off_the_gpu(async_runs: tuple[list[Any], Path]) -> None:
    runs, _ = async_runs
    for rank, run in enumerate(_ran(run) for run in runs):
        assert run["staged"] > 0, run["staged"]  # params + AdamW shards, held on the host
        if not ON_GPU:
            continue  # (CPU processes: no device memory to see)
        print(f"rank {rank}: staged {run['staged'] / 2**10:.0f} KiB, GPU grew {run['grown'] / 2**10:.0f} KiB")
        assert run["grown"] < run["staged"] / 2, \
            f"rank {rank}: GPU memory grew {run['grown']} B during the write of {run['staged']} staged B"


# -- offloaded state through a checkpoint --------------------------------------------------------
OFFLOADS = ["optimizer", "params"]


def _offload(folder: str) -> dict[str, Any]:
    _start()
    return {offload: _guarded(_offload_runs, Path(folder) / offload, offload) for offload in OFFLOADS}


def _offload_runs(root: Path, offload: str) -> dict[str, Any]:
    engine = _engine(strategy="zero3", offload=offload, checkpoint_dir=str(root))

    def at_step(step: int, model: Any, opt: Any) -> None:
        if step == 3:
            engine.save_state()

    straight = CA._loop(engine, 6, at_step=at_step)
    engine.free_memory()
    again = _engine(strategy="zero3", offload=offload, checkpoint_dir=str(root))
    resumed = CA._loop(again, 6, load=str(root / "step_3"))
    again.free_memory()
    return {"straight": _cpu(straight), "resumed": _cpu(resumed)}


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return spawn(_offload, 2, str(tmp_path_factory.mktemp("offload")), timeout=TIMEOUT)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_offloaded_state_resumes_bit_identical(offload_runs: list[Any], offload: str) -> None:
    ref = W.plain_reference(6, CA.N, 4, DEVICE)
    for rank, res in enumerate(offload_runs):
        run = _ran(res[offload])
        straight, resumed = run["straight"], run["resumed"]
        assert straight["losses"][3:] == resumed["losses"], (rank, straight["losses"], resumed["losses"])
        assert CA._identical(straight["state"], resumed["state"]), f"{offload}, rank {rank}: resumed weights"
        assert all(CA._identical(a, b) for a, b in zip(straight["optim"], resumed["optim"])), \
            f"{offload}, rank {rank}: resumed optimizer state"
        assert W.close(straight["losses"], ref.losses) < 1e-5, (offload, straight["losses"], ref.losses)
        if rank == 0:  # (the full weights: on the main process)
            assert W.max_diff(straight["state"], ref.state) < 2e-5, offload


# -- hybrid sharding: 4 processes as 2 groups of 2 -----------------------------------------------
HYBRID_RUN = {"batch": 2, "accum": 2, "steps": 4}


def _hybrid() -> Any:
    _start()
    return _guarded(lambda: _cpu(W.train_engine("tiny", {"strategy": "zero3", "shard_group_size": 2,
                                                          "cpu": not ON_GPU, "preempt_signals": ()},
                                                 **HYBRID_RUN)))


def test_hybrid_zero3_on_one_gpu_matches_one_process() -> None:
    runs = spawn(_hybrid, 4, timeout=TIMEOUT)
    ref = W.reference("tiny", world=4, device=DEVICE, **HYBRID_RUN)
    W.check_matches(_ran(runs[0]), ref, "hybrid zero3, 2 groups of 2", "tiny")  # (rank 0: the full weights)


# -- context parallelism 2, expert parallelism 2 --------------------------------------------------
# gloo's send and recv hand the tensor's data pointer to its TCP transport as it is, with no copy
# to the host (its collectives copy CUDA tensors through pinned buffers): the ring's
# batch_isend_irecv of CUDA tensors cannot run on gloo, only on NCCL, one GPU per process
RING_ON_GLOO = "the ring's send/recv: gloo's send and recv take host memory only (NCCL: one GPU per process)"
CP_METHODS = ["ulysses"] if ON_GPU else ["ring", "ulysses"]


def _cp_both() -> dict[str, Any]:
    _start()
    return {method: _guarded(_cp, method) for method in CP_METHODS}


def _ep_run() -> Any:
    _start()
    return _guarded(_ep)


def _cp(method: str) -> dict[str, Any]:
    engine = _engine(strategy="zero3", context_parallel=method, context_parallel_size=2,
                     tile_tokens=CP.TILE)
    model = CP.build("plain")
    opt = torch.optim.AdamW(model.parameters(), lr=CP.LR)
    data = CP.Batches(CP.BATCH * CP.STEPS, "plain")
    model, opt, loader = engine.prepare(model, opt, DataLoader(data, batch_size=CP.BATCH))
    losses, norms = [], []
    for batch in loader:
        loss = model(**batch).loss
        engine.backward(loss)
        norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    state = _cpu(engine.get_state_dict(model))
    engine.free_memory()
    return {"losses": losses, "norms": norms, "state": state}


def _ep() -> dict[str, Any]:
    engine = _engine(strategy="zero3", expert_parallel_size=2)
    model = EP.build("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=EP.LR)
    model, opt = engine.prepare(model, opt)
    losses, norms = [], []
    for batch in EP._my_batches(engine):
        loss, norm = EP._step(engine, model, opt, {k: v.to(engine.device) for k, v in batch.items()})
        losses.append(loss)
        norms.append(norm)
    state = _cpu(engine.get_state_dict(model))
    engine.free_memory()
    return {"losses": losses, "norms": norms, "state": state}


@pytest.fixture(scope="module")
def cp_runs() -> list[Any]:
    return spawn(_cp_both, 2, timeout=TIMEOUT)


def _cp_reference() -> dict[str, Any]:
    """One plain process on the device, the cp runs' batches (tests/test_context_parallel.py's)."""
    model = CP.build("plain").to(DEVICE)
    batches = [{k: v.to(DEVICE) for k, v in b.items()}
               for b in DataLoader(CP.Batches(CP.BATCH * CP.STEPS, "plain"), batch_size=CP.BATCH)]
    return W.train_plain(model, batches, CP.LR)


def _check(run: dict[str, Any], ref: dict[str, Any], case: str, weight_tol: float) -> None:
    assert W.close(run["losses"], ref["losses"]) < 1e-5, \
        f"{case}: losses {run['losses']}, one process's {ref['losses']}"
    assert W.close(run["norms"], ref["norms"]) < 1e-5 * max(ref["norms"]), \
        f"{case}: clipped norms {run['norms']}, one process's {ref['norms']}"
    if run["state"] or case.endswith("rank 0"):  # (the full weights: on the main process)
        worst = W.max_diff(run["state"], _cpu(ref["state"]))
        assert worst <= weight_tol, f"{case}: weights {worst:.2e} from one process's"


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp2_on_one_gpu_matches_one_process(method: str, request: pytest.FixtureRequest) -> None:
    if method not in CP_METHODS:
        pytest.skip(f"cannot run on one GPU: {RING_ON_GLOO}")
    runs = request.getfixturevalue("cp_runs")
    ref = _cp_reference()
    bound = max(CP.WEIGHT_TOL, 3 * CP._floor("plain", 1))
    for rank, res in enumerate(runs):
        _check(_ran(res[method]), ref, f"cp 2 {method}, rank {rank}", bound)


def test_ep2_on_one_gpu_matches_one_process() -> None:
    runs = spawn(_ep_run, 2, timeout=TIMEOUT)
    model = EP.build("mixtral").to(DEVICE)
    batches = [{k: v.to(DEVICE) for k, v in b.items()}
               for b in DataLoader(EP.samples(2 * EP.BATCH * EP.STEPS), batch_size=2 * EP.BATCH)]
    ref = W.train_plain(model, batches, EP.LR)
    for rank, res in enumerate(runs):
        _check(_ran(res), ref, f"ep 2, rank {rank}", EP.WEIGHT_TOL)


def test_every_process_shared_the_one_device() -> None:
    """What the file stands on: 2 workers, each its own default group of gloo for both device
    types, both on the same device (cuda:0 on a GPU)."""
    got = spawn(_where, 2, timeout=TIMEOUT)
    assert [g[0] for g in got] == ["cpu:gloo,cuda:gloo"] * 2, got
    assert {g[1] for g in got} == {"cuda:0" if ON_GPU else "cpu"}, got


def _where() -> tuple[str, str]:
    import torch.distributed as dist

    _start()
    engine = _engine(strategy="zero3")
    return str(dist.get_backend()), str(engine.device)
