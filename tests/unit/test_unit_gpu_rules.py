"""The code only a GPU runs, run on CPU by the GPU's rules (tests/fake_cuda.py).

Each test runs the real code path with a mesh typed "cuda" (its group gloo's, its DTensors' local
parts on the host) or with `torch.cuda` faked, and checks what a GPU run would have done: a shard
moved onto the device, a thread on another process's GPU, a pinned block twice its size, a
generator state that cannot load, a clock read before the device finished. Every check is the
function a planted fault (tests/planted.py) shows failing for its reason.
"""

from __future__ import annotations

import io
import re
import threading
import time
import tokenize
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import DeviceMoves, FakeCuda, cuda_mesh
from planted import caught, planted_here
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.distributed.internals import local_tensor, shard_like, with_local


def _host_dtensor(mesh: Any, whole: torch.Tensor, placements: Any = None) -> DTensor:
    """A DTensor on `mesh` (typed "cuda") whose local part lives on the host: an offloaded
    parameter, a staged shard."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(whole.shape, whole.stride(), whole.dtype)
    spec = DTensorSpec(mesh, tuple(placements or (Shard(0),)), tensor_meta=meta)
    return DTensor(whole.clone(), spec, requires_grad=False)


def _no_moves(moves: DeviceMoves, what: str) -> None:
    assert not moves.moves, f"{what} moved {len(moves.moves)} tensor(s) to the GPU: {moves.moves[:4]}"


# -- 1. asynchronous checkpoints stage on the host ------------------------------------------------
def check_staging_stays_on_the_host() -> None:
    """`stage` copies a sharded state dict (a DTensor shard, its AdamW state, a plain tensor) into
    host memory and rebuilds each DTensor on its mesh without moving the copy to the device."""
    from shardwise.checkpoint.background import stage

    with cuda_mesh() as mesh:
        w = _host_dtensor(mesh, torch.randn(6, 4))
        state = {"model": {"w": w, "b": torch.randn(4)},
                 "optim": {"w": {"exp_avg": _host_dtensor(mesh, torch.randn(6, 4))}}}
        with DeviceMoves() as moves:
            staged, nbytes = stage(state)
        _no_moves(moves, "staging an asynchronous checkpoint")
        out = staged["model"]["w"]
        assert isinstance(out, DTensor) and out.placements == w.placements and out.shape == w.shape
        assert local_tensor(out).device.type == "cpu"
        assert local_tensor(out).data_ptr() != local_tensor(w).data_ptr(), "the staged copy aliases the shard"
        assert torch.equal(local_tensor(out), local_tensor(w)) and nbytes == 2 * 6 * 4 * 4 + 4 * 4


def test_staging_keeps_the_copy_on_the_host() -> None:
    check_staging_stays_on_the_host()


def test_planted_staged_on_the_gpu_is_caught() -> None:
    with planted_here("staged_on_the_gpu"):
        caught(check_staging_stays_on_the_host,
               must=r"staging an asynchronous checkpoint moved 2 tensor\(s\) to the GPU")


# -- 2. the writer thread works on the training's GPU -----------------------------------------------
def check_writer_on_the_training_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A write started by local rank 1 (cuda:1) runs its job on cuda:1, not on GPU 0 where a new
    thread starts."""
    from shardwise.checkpoint.background import BackgroundWriter

    fake = FakeCuda(devices=2).install(monkeypatch)
    fake.set_device(1)  # the training's thread: the engine set its local rank's GPU
    seen: list[int] = []
    writer = BackgroundWriter(torch.device("cuda", 1))
    writer.start(tmp_path / "step_1", 0, lambda: seen.append(torch.cuda.current_device()))
    writer.wait()
    assert seen == [1], f"the checkpoint writer thread ran on cuda:{seen[0]}, the training on cuda:1"


def test_the_writer_thread_works_on_the_training_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    check_writer_on_the_training_device(monkeypatch, tmp_path)


def test_planted_writer_on_gpu0_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with planted_here("writer_on_gpu0"):
        caught(check_writer_on_the_training_device, monkeypatch, tmp_path,
               must=r"the checkpoint writer thread ran on cuda:0, the training on cuda:1")


# -- 2b. pinned staging buffers of exactly their bytes --------------------------------------------
def check_pinned_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging pool's pinned buffers hold what `held_bytes` counts: registered at their own
    size (20000 bytes for 5000 floats), not a caching-allocator block rounded to 32768."""
    from shardwise.checkpoint.background import _Pool

    fake = FakeCuda().install(monkeypatch)
    pool = _Pool()
    with DeviceMoves() as moves:
        buf = pool.take(0, torch.empty(5000))
    pinned = sum(fake.registered.values()) + sum(moves.pinned_blocks)
    assert pinned == pool.nbytes() == 20000, f"{pinned} host bytes pinned for {pool.nbytes()} counted"
    assert fake.registered == {buf.data_ptr(): 20000}
    del buf, pool
    # the offloaded optimizer's fp32 masters and host gradients (a CUDA run's, pinned): each
    # exactly its 5000 x 4 bytes, as memory_report() counts them
    fake.registered.clear()
    with cuda_mesh() as mesh:
        model = nn.Linear(1000, 5, bias=False)
        model.weight = nn.Parameter(_host_dtensor(mesh, model.weight.detach()))
        opt = torch.optim.AdamW(model.parameters())
        with DeviceMoves() as moves:
            runner = _host_runner(opt, torch.device("cuda", 0))
        pinned = sum(fake.registered.values()) + sum(moves.pinned_blocks)
        counted = sum(t.numel() * t.element_size() for t in runner.tensors())
        assert pinned == counted == 40000, f"{pinned} host bytes pinned for {counted} counted"


def _host_runner(opt: torch.optim.Optimizer, device: torch.device) -> Any:
    """zero2/zero3 + optimizer offload's runner of `opt` (fp32 masters on the host)."""
    from shardwise.config.tree import EngineConfig
    from shardwise.distributed.world import DistInfo
    from shardwise.strategies.sharded_optim import optimizer_runner

    return optimizer_runner(opt, EngineConfig.of(strategy="zero2"), DistInfo(0, 1, 0, 1, device),
                            partition="local", host=True)


def test_pinned_staging_is_its_own_size(monkeypatch: pytest.MonkeyPatch) -> None:
    check_pinned_exactly(monkeypatch)


def test_planted_pinned_by_the_caching_allocator_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("pinned_by_the_caching_allocator"):
        caught(check_pinned_exactly, monkeypatch, must=r"32768 host bytes pinned for 20000 counted")
    with planted_here("pinned_by_the_caching_allocator"):  # the staging pool kept: the masters' own
        from shardwise.checkpoint import background

        monkeypatch.setattr(background, "pinned", background.pinned.__wrapped__)
        caught(check_pinned_exactly, monkeypatch, must=r"65536 host bytes pinned for 40000 counted")


# -- 3. offloaded optimizer state is saved and loaded on the host ----------------------------------
def check_offloaded_state_checkpointed_on_the_host() -> None:
    """zero2/zero3 + optimizer offload (`ShardedOptimizer`, partition "local", host masters):
    its checkpoint state is its AdamW shards as DTensors on the parameters' mesh, their local
    parts the host state itself (zero-copy: DCP reads from it and loads into it), no GPU copy."""
    with cuda_mesh() as mesh:
        model = nn.Linear(4, 6)
        for name in ("weight", "bias"):
            whole = getattr(model, name).detach()
            setattr(model, name, nn.Parameter(_host_dtensor(mesh, whole)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runner = _host_runner(opt, torch.device("cpu"))
        for p in model.parameters():
            p.grad = with_local(torch.ones_like(local_tensor(p)), p)
        runner.step()
        with DeviceMoves() as moves:
            state = runner.checkpoint_state(model)
        _no_moves(moves, "the offloaded optimizer's checkpoint state")
        exp_avg = state["state"]["weight"]["exp_avg"]
        assert isinstance(exp_avg, DTensor) and local_tensor(exp_avg).device.type == "cpu"
        assert local_tensor(exp_avg).abs().sum() > 0
        with DeviceMoves() as moves:
            runner.load_checkpoint_state(model, state)
        _no_moves(moves, "loading the offloaded optimizer's state")


def test_offloaded_optimizer_state_is_checkpointed_on_the_host() -> None:
    check_offloaded_state_checkpointed_on_the_host()


def test_planted_offloaded_state_to_gpu_is_caught() -> None:
    with planted_here("offloaded_state_to_gpu"):
        caught(check_offloaded_state_checkpointed_on_the_host,
               must=r"the offloaded optimizer's checkpoint state moved 4 tensor\(s\) to the GPU")


# -- 4. state cut beside an offloaded parameter -----------------------------------------------------
def check_state_cut_beside_offloaded_params() -> None:
    """Under `offload: params` a parameter is a DTensor on the GPU's mesh whose shard is on the
    host: an EMA shadow, a whole value loaded into it and optimizer state rebound to it are cut
    to its layout on the host, beside it, never on the GPU."""
    from shardwise.weights import ema

    with cuda_mesh() as mesh:
        param = _host_dtensor(mesh, torch.randn(6, 4))
        whole = torch.randn(6, 4)
        with DeviceMoves() as moves:
            cuts = {"EMA shadow": ema._like(whole, param), "a loaded value": shard_like(whole, param),
                    "a bf16 value": shard_like(whole, param, dtype=torch.bfloat16)}
        _no_moves(moves, "cutting state beside an offloaded parameter")
        for what, cut in cuts.items():
            assert isinstance(cut, DTensor) and local_tensor(cut).device.type == "cpu", what
            assert torch.equal(local_tensor(cut).float(), whole.to(local_tensor(cut).dtype).float()), what
        replicated = _host_dtensor(mesh, torch.randn(3), (Replicate(),))
        assert local_tensor(shard_like(whole[0, :3], replicated)).device.type == "cpu"


def test_state_is_cut_beside_offloaded_params() -> None:
    check_state_cut_beside_offloaded_params()


def test_planted_state_cut_on_the_gpu_is_caught() -> None:
    with planted_here("state_cut_on_the_gpu"):
        caught(check_state_cut_beside_offloaded_params,
               must=r"cutting state beside an offloaded parameter moved \d+ tensor\(s\) to the GPU")


# -- 8a. a resume where fewer GPUs are visible ------------------------------------------------------
def check_rng_resumes_with_fewer_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved by local rank 1 of a node showing 2 GPUs, resumed by a process that sees one (its
    own GPU, index 0): the checkpoint's CUDA generator is that process's own, and it loads."""
    from shardwise.checkpoint import sharded

    saver = FakeCuda(devices=2).install(monkeypatch)
    saver.set_device(1)
    state = sharded._rng_state()
    mine = saver.rng[1].clone()
    loader = FakeCuda(devices=1).install(monkeypatch)
    try:
        sharded._set_rng_state(state)
    except RuntimeError as err:
        raise AssertionError(f"a resume seeing 1 GPU failed to restore the generators: {err}") from err
    assert torch.equal(loader.rng[0], mine), "the resumed GPU's generator is not the saving process's own"


def test_rng_state_resumes_where_fewer_gpus_are_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    state = torch.get_rng_state()
    try:
        check_rng_resumes_with_fewer_gpus(monkeypatch)
    finally:
        torch.set_rng_state(state)


def test_planted_rng_of_every_gpu_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    state = torch.get_rng_state()
    try:
        with planted_here("rng_of_every_gpu"):
            caught(check_rng_resumes_with_fewer_gpus, monkeypatch,
                   must=r"a resume seeing 1 GPU failed to restore the generators: "
                        r"CUDA error: invalid device ordinal")
    finally:
        torch.set_rng_state(state)


# -- 8b. throughput measured after the device finished -------------------------------------------
def check_clock_after_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics record's interval ends after the GPU finished its kernels: the device is
    synchronized before the clock is read (tokens/s and MFU otherwise count queued work as done)."""
    from shardwise.distributed.world import DistInfo
    from shardwise.runtime import metrics

    fake = FakeCuda(devices=1).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    clocks: list[float] = []

    class _Clock:
        @staticmethod
        def perf_counter() -> float:
            now = time.perf_counter()
            clocks.append(now)
            return now

    with DeviceMoves():
        meter = metrics.Meter(DistInfo(0, 1, 0, 1, torch.device("cuda", 0)), 1, peak=1.0, flops_per_token=1.0)
        monkeypatch.setattr(metrics, "time", _Clock)
        meter.on_batch({"input_ids": torch.ones(2, 8, dtype=torch.long)})
        meter.on_backward(torch.tensor(1.0))
        meter.due(1)
        fake.syncs.clear()
        meter.record(1, None, {})
    assert clocks, "the record read no clock"
    assert fake.syncs and fake.syncs[0] <= clocks[0], "the record read the clock before synchronizing the GPU"


def test_throughput_reads_the_clock_after_the_gpu_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    check_clock_after_sync(monkeypatch)


def test_planted_clock_before_sync_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("clock_before_sync"):
        caught(check_clock_after_sync, monkeypatch,
               must=r"the record read the clock before synchronizing the GPU")


def test_the_fake_is_the_gpus_rules() -> None:
    """The shims themselves: a move is recorded and not done; a new thread starts on GPU 0."""
    fake = FakeCuda(devices=2)
    fake.set_device(1)
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(fake.current_device()))
    t.start()
    t.join()
    assert seen == [0] and fake.current_device() == 1
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        fake.set_device(2)
    with DeviceMoves() as moves:
        x = torch.ones(3).to("cuda")
        torch.empty(5000, pin_memory=True)
    assert x.device.type == "cpu" and moves.moves == [("to", (3,))] and moves.pinned_blocks == [32768]


# -- the unsafe patterns, read in the source ---------------------------------------------------------
SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"

# (pattern, what it does on a GPU, {module: why it is right there})
UNSAFE = [
    (r"DTensor\.from_local\(|\bdistribute_tensor\(",
     "moves the local part to the mesh's device (an offloaded or staged host shard copied to the GPU): "
     "use distributed.internals.with_local / shard_like",
     {"distributed/internals.py": "the helpers themselves, the device chosen",
      "strategies/tensor_parallel.py": "splits parameters before any sharding or offload, on the mesh's "
                                       "device",
      "strategies/expert_parallel.py": "splits experts before any sharding or offload, on the mesh's device",
      "strategies/fsdp.py": "rebind_state's scatter from process 0 (on the mesh's device), kept beside "
                            "the parameter"}),
    (r"pin_memory=True|\.pin_memory\(\)|pin_memory=pin\b",
     "takes a caching-allocator block rounded up to a power of two: use distributed.host.pinned",
     {"strategies/blocks.py": "activation offload's copies, recycled step after step by the allocator"}),
    (r"get_rng_state_all|set_rng_state_all",
     "every visible GPU's generator: a resume seeing fewer GPUs fails; this process's own only", {}),
    (r"get_backend\([^)]*\)\s*[!=]=",
     "the default group's backend is \"cpu:gloo,cuda:nccl\" on a GPU: a comparison with one name is "
     "dead", {}),
    (r"threading\.Thread\(",
     "a new thread starts on GPU 0: one that touches CUDA must set the training's device first",
     {"runtime/supervision.py": "the watch thread reads signals and the clock, no CUDA",
      "checkpoint/runlock.py": "the lock's heartbeat writes a file, no CUDA"}),
]


def unsafe_uses() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        for n, code in _code_lines(text).items():
            line = lines[n - 1]
            for pattern, why, allowed in UNSAFE:
                if re.search(pattern, code) and rel not in allowed and not _thread_sets_device(pattern, path):
                    found.append(f"{rel}:{n}: {line.strip()} -- {why}")
    return found


def _code_lines(text: str) -> dict[int, str]:
    """Each line's code without its strings and comments (a docstring may name a pattern)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                            tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT):
            out[tok.start[0]] = out.get(tok.start[0], "") + tok.string
    return out


def _thread_sets_device(pattern: str, path: Path) -> bool:
    return pattern.startswith("threading") and "torch.cuda.set_device(" in path.read_text()


def check_no_unsafe_gpu_pattern() -> None:
    found = unsafe_uses()
    assert not found, "a pattern that is wrong on a GPU:\n" + "\n".join(found)


def test_no_pattern_that_is_wrong_on_a_gpu() -> None:
    check_no_unsafe_gpu_pattern()


def test_planted_stage_by_from_local_is_caught() -> None:
    """`stage_by_from_local`: the staging copy rebuilt with `DTensor.from_local` again, read in the
    source as if `checkpoint/background.py` held it."""
    with planted_here("stage_by_from_local"):
        caught(check_no_unsafe_gpu_pattern,
               must=r"checkpoint/background\.py:\d+: out = DTensor\.from_local\(buf, t\.device_mesh.* "
                    r"-- moves the local part")


# -- 7. a hung NCCL collective: the hang watch -------------------------------------------------------
def check_hang_watch_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the watch ends a process with no progress for the timeout while the device's
    stream stays busy (a hung NCCL kernel), with the timeout's line; not while beats come, and not
    when the device is idle (the script's own CPU work between steps)."""
    from shardwise.runtime.hang import HangWatch

    FakeCuda(devices=2).install(monkeypatch)
    busy = [True]

    class _Stream:
        def query(self) -> bool:
            return not busy[0]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    ended: list[str] = []
    watch = HangWatch(0.3, torch.device("cuda", 1), lambda: "rank 1: step 3: a collective did not complete",
                      end=ended.append, period_s=0.05)
    try:
        for _ in range(10):  # 0.6 s of progress: beats every 0.06 s
            watch.beat()
            time.sleep(0.06)
        assert not ended, f"the watch ended a process making progress: {ended}"
        busy[0] = False  # 0.6 s without a beat, the device idle: the script's own work
        time.sleep(0.6)
        assert not ended, f"the watch ended a process whose device was idle: {ended}"
        busy[0] = True  # the device's work no longer finishes
        deadline = time.monotonic() + 2.0
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended == ["rank 1: step 3: a collective did not complete"], \
            f"no progress for 0.3 s with the device busy, and the watch said {ended}"
    finally:
        watch.close()


def test_the_hang_watch_ends_a_process_stuck_on_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    check_hang_watch_on_a_gpu(monkeypatch)


def test_planted_hang_watch_ignores_the_device_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("hang_watch_ignores_the_device"):
        caught(check_hang_watch_on_a_gpu, monkeypatch,
               must=r"the watch ended a process whose device was idle: \['rank 1")


def test_the_group_timeout_on_a_gpu_leaves_the_watch_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the default group (NCCL's watchdog) times out NCCL_BACKSTOP_S after
    collective_timeout_s, where the watch has spoken; on CPU at collective_timeout_s itself."""
    import datetime

    import torch.distributed as dist

    from shardwise.distributed import world

    FakeCuda(devices=1).install(monkeypatch)
    made: list[tuple[str, datetime.timedelta]] = []
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: made.append((backend, kw["timeout"])))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(world, "_TIMEOUT", [None])  # (the module's record of the group's timeout)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    world.init_distributed(force_cpu=False, timeout_s=100.0)
    world.init_distributed(force_cpu=True, timeout_s=100.0)
    assert made == [("cpu:gloo,cuda:nccl", datetime.timedelta(seconds=100.0 + world.NCCL_BACKSTOP_S)),
                    ("gloo", datetime.timedelta(seconds=100.0))], made
    assert world.NCCL_BACKSTOP_S >= 30
