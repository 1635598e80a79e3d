"""The speed features side by side, at the ~100M GPT on 2 processes, in one run:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/speed_features.py

compile      eager vs `compile: true` (each block compiled by inductor): the first step (compiling
             included) and the median step after it, per strategy; the losses of both runs agree.
async        the training stall of one `save_state` (model + AdamW state, zero3): synchronous (the
             whole save) against `checkpoint_async: true` (staging to host memory; the write goes on
             in the background), and how much slower the steps taken during the background write are.
             Goal: the asynchronous stall at most 15% of the synchronous save.
ac           activation_checkpointing none / full / selective / offload (zero3): the bytes a forward
             leaves alive for backward, the peak per process over forward and backward (the state
             held plus a dispatch-mode count of what the step allocates) and the median step time.
             On a CPU machine offload copies host memory to host memory: it saves nothing here; the
             device memory it frees shows on a GPU (benchmarks/gpu_session.sh).

`--tiny` runs every part on a small GPT in seconds (tests/test_benchmarks.py runs it so).
Writes benchmarks/results/speed_features-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, finish_distributed, lm_loss

import shardwise

FULL = {"vocab": 32000, "d": 768, "layers": 12, "heads": 12}
TINY = {"vocab": 256, "d": 64, "layers": 4, "heads": 4}


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storage (each storage once, dropped when its last reference dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.now = self.peak = 0

    def see(self, t: torch.Tensor) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        key, n = st._cdata, st.nbytes()  # (one Python object per storage, as tests/test_plan.py counts)
        if key not in self.sizes:
            self.refs[key] = weakref.ref(st, functools.partial(self._drop, key))
            self.sizes[key] = 0
        self.now += n - self.sizes[key]
        self.sizes[key] = n
        self.peak = max(self.peak, self.now)

    def _drop(self, key: int, _ref: Any) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.see(t)
        return out


class Run:
    """One engine, its model and AdamW, and a fixed stream of batches."""

    def __init__(self, size: dict[str, int], seq: int, batch: int, **settings: Any) -> None:
        self.engine = shardwise.Engine(preempt_signals=(),
                                       seed=0, cpu=not torch.cuda.is_available(), **settings)
        model = GPT(block=seq, **size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.model, self.optimizer = self.engine.prepare(model, optimizer)
        g = torch.Generator().manual_seed(1 + self.engine.process_index)
        self.batches = [torch.randint(0, size["vocab"], (batch, seq + 1), generator=g).to(self.engine.device)
                        for _ in range(16)]
        self.done = 0

    def step(self) -> float:
        """One training step, timed between barriers; returns seconds."""
        dist.barrier()
        t0 = time.perf_counter()
        loss = lm_loss(self.model, self.batches[self.done % len(self.batches)])
        self.engine.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.last_loss = loss.item()
        self.done += 1
        dist.barrier()
        return time.perf_counter() - t0

    def steps(self, n: int) -> list[float]:
        return [self.step() for _ in range(n)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


Say = Callable[[str], None]


def part_compile(size: dict[str, int], args: argparse.Namespace, say: Say) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for strategy in args.strategies:
        eager = Run(size, args.seq, args.batch, strategy=strategy)
        eager_first = eager.step()
        eager_steps = eager.steps(args.steps)
        eager_losses = eager.last_loss
        del eager
        compiled = Run(size, args.seq, args.batch, strategy=strategy, compile=True)
        first = compiled.step()
        steps = compiled.steps(args.steps)
        row = {
            "eager_first_step_s": round(eager_first, 3),
            "eager_median_step_s": round(_median(eager_steps), 3),
            "compiled_first_step_s": round(first, 2),
            "compiled_median_step_s": round(_median(steps), 3),
            "speedup": round(_median(eager_steps) / _median(steps), 3),
            "startup_s": round(first - _median(steps), 1),
            "last_loss_eager": round(eager_losses, 6),
            "last_loss_compiled": round(compiled.last_loss, 6),
        }
        rows[strategy] = row
        say(f"compile {strategy:5s} eager {row['eager_median_step_s']:.3f} s/step, compiled "
            f"{row['compiled_median_step_s']:.3f} s/step (x{row['speedup']:.2f}), compile start-up "
            f"{row['startup_s']:.1f} s; last loss {row['last_loss_eager']:.5f} vs "
            f"{row['last_loss_compiled']:.5f}")
        del compiled
    return rows


def _save_stall(run: Run, target: Path, steps_after: int) -> dict[str, float]:
    """Seconds the training loop was blocked by one save_state, and the steps right after it."""
    dist.barrier()
    t0 = time.perf_counter()
    run.engine.save_state(target)
    dist.barrier()
    stall = time.perf_counter() - t0
    after = run.steps(steps_after)
    t1 = time.perf_counter()
    run.engine.wait_for_checkpoint()  # the background write (if any) finishes
    dist.barrier()
    return {"stall_s": stall, "after_steps": after, "wait_after_s": time.perf_counter() - t1}


def part_async(size: dict[str, int], args: argparse.Namespace, say: Say) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="shardwise-speed-")) if dist.get_rank() == 0 else None
    holder = [str(root)]
    dist.broadcast_object_list(holder)
    root = Path(holder[0])
    out: dict[str, Any] = {}
    for name, flag in (("sync", False), ("async", True)):
        run = Run(size, args.seq, args.batch, strategy="zero3", checkpoint_async=flag,
                  checkpoint_dir=str(root / name))
        normal = run.steps(args.steps + 1)[1:]  # (the first step builds AdamW's state)
        stalls, slower = [], []
        for k in range(args.saves):
            r = _save_stall(run, root / name / f"save{k}", args.steps)
            stalls.append(r["stall_s"])
            slower.append(sum(max(0.0, s - _median(normal)) for s in r["after_steps"]) + r["wait_after_s"])
        out[name] = {"median_step_s": round(_median(normal), 3), "stall_s": round(_median(stalls), 3),
                     "steps_slowed_by_s": round(_median(slower), 3)}
        del run
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    out["async_stall_share_of_sync"] = round(out["async"]["stall_s"] / out["sync"]["stall_s"], 3)
    say(f"async  sync save stalls {out['sync']['stall_s']:.2f} s; async {out['async']['stall_s']:.3f} s "
        f"({out['async_stall_share_of_sync']:.1%} of sync; goal <= 15%); the steps during the background "
        f"write were {out['async']['steps_slowed_by_s']:.2f} s slower in all")
    return out


def _measured_step(run: Run) -> tuple[float, float]:
    """One step with its memory measured: the bytes the forward leaves alive for backward (the
    saved activations, the loss, the logits) and the peak from the forward's start to the end of
    backward, both above what the process held before it (the optimizer step's own transient
    peak, the same for every mode, is left out). A dispatch-mode counter on CPU; the CUDA
    allocator's statistics on a GPU."""
    ids = run.batches[run.done % len(run.batches)]
    cuda = torch.cuda.is_available()
    live = LiveBytes()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with contextlib.nullcontext() if cuda else live:
        loss = lm_loss(run.model, ids)
        kept = (torch.cuda.memory_allocated() - base) if cuda else live.now
        run.engine.backward(loss)
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else live.peak
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.done += 1
    return kept, peak


def part_ac(size: dict[str, int], args: argparse.Namespace, say: Say) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for mode in ("none", "full", "selective", "offload"):
        run = Run(size, args.seq, args.batch, strategy="zero3", activation_checkpointing=mode)
        run.step()  # AdamW's state exists from here on
        times = run.steps(args.steps)
        state = run.engine.memory_report().total  # what the process holds between steps
        kept, peak = _measured_step(run)
        rows[mode] = {"median_step_s": round(_median(times), 3),
                      "kept_for_backward_mib": round(kept / 2**20, 1),
                      "peak_mib": round((state + peak) / 2**20, 1)}
        say(f"ac     {mode:9s} {rows[mode]['median_step_s']:.3f} s/step, forward leaves "
            f"{rows[mode]['kept_for_backward_mib']:.1f} MiB for backward, peak (forward + backward) "
            f"{rows[mode]['peak_mib']:.1f} MiB per process")
        del run
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["compile", "async", "ac"]
    ap.add_argument("--parts", nargs="+", default=names, choices=names)
    ap.add_argument("--strategies", nargs="+", default=["ddp", "zero2", "zero3"])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    ap.add_argument("--saves", type=int, default=2, help="saves per mode (the median stall is reported)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="a small GPT: a dry run in seconds")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq = min(args.seq, 32)
    size = TINY if args.tiny else FULL
    if not dist.is_initialized():  # (the engines join this group)
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)

    def say(line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)

    parts = {"compile": part_compile, "async": part_async, "ac": part_ac}
    results = {name: parts[name](size, args, say) for name in args.parts}
    params = sum(p.numel() for p in GPT(block=args.seq, **size).parameters())
    finish_distributed("speed_features", {
        "model": f"GPT d{size['d']} L{size['layers']} vocab{size['vocab']} ({params / 1e6:.1f}M parameters), "
                 f"AdamW, batch {args.batch} x {args.seq} tokens per process, fp32",
        "results": results,
    }, args.out)


if __name__ == "__main__":
    main()
