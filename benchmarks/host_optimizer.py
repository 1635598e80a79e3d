"""The host optimizer step of CPU offload, in elements per second, side by side in one run.

    python benchmarks/host_optimizer.py                    # 50M and 200M elements, 5 rounds
    python benchmarks/host_optimizer.py --sizes 50 --rounds 3

One process, fp32 AdamW over N elements with gradients present. Each round builds every way
afresh and times --steps steps of it after one warm step (state allocated, kernels chosen), in
alternating order (the next round reverses it). Reported per way: the median over all timed steps,
the spread (lowest and highest per-round median), elements/s at the median, and the ratios to
DeepSpeedCPUAdam and to DeepSpeed's own offload step.
  plain          torch.optim.AdamW(params), as users write it (the single-tensor loop on CPU)
  foreach        the same with foreach=True
  fused          the same with fused=True (torch's fused CPU kernel)
  ds_cpu_adam    DeepSpeed's DeepSpeedCPUAdam (what DeepSpeed's offload swaps in), if installed
  shardwise      shardwise's optimizer-offload step on the torch backend (zero2 + offload
                 "optimizer"): the user's plain AdamW, stepped by the runner on the host masters
                 (on a CPU device the masters are the parameters' own storage: no copies)
  shardwise_dsk  the same with host_kernel="deepspeed" (DeepSpeed's CPUAdam steps the masters)
  shardwise_ds   shardwise on backend="deepspeed" (DeepSpeed ZeRO-2 with optimizer offload) with
                 the user's AdamW; the step is DeepSpeed's: the host step plus its two copies of
                 the fp32 partition back into the model's parameters
  deepspeed      DeepSpeed used directly the same way (ZeRO-2, offload_optimizer cpu) with
                 DeepSpeedCPUAdam, timing `engine.step()`: the reference for shardwise_ds
Threads: each way runs with the threads this process may use (torch.set_num_threads is set to
the CPUs in its affinity mask for the run), as an offload step would.
Writes benchmarks/results/host_optimizer-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
WAYS = ["plain", "foreach", "fused", "ds_cpu_adam", "shardwise", "shardwise_dsk", "shardwise_ds", "deepspeed"]


SIDE = 4096


def _shape(numel: int) -> tuple[int, int]:
    """(side, layers) of square linears holding about `numel` elements (4096-wide from 16M up)."""
    side = SIDE if numel >= SIDE**2 else max(8, math.isqrt(numel))
    return side, max(1, round(numel / side**2))


def _model(numel: int) -> nn.Module:
    """Square linears (no bias) holding about `numel` elements in all."""
    side, layers = _shape(numel)
    return nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(layers)))


def _plain_way(model: nn.Module, **kw: Any) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return opt.step


def _ds_cpu_adam(model: nn.Module) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return opt.step


def _deepspeed(model: nn.Module) -> Callable[[], None]:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3

    def step() -> None:
        engine.step()

    step.close = engine.destroy  # type: ignore[attr-defined]  # its hooks would keep it alive
    return step


def _shardwise(model: nn.Module, backend: str, kernel: str = "torch") -> Callable[[], None]:
    import shardwise

    engine = shardwise.Engine(preempt_signals=(),
        strategy="zero2", offload="optimizer", backend=backend, cpu=True, host_kernel=kernel
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # as users write it
    model, opt = engine.prepare(model, opt)
    runner = opt.runner
    grads = [torch.randn_like(p) * 1e-3 for p in runner.params()]

    def step() -> None:
        for p, g in zip(runner.params(), grads, strict=True):
            p.grad = g
        engine.session.strategy.optimizer_step(runner, clip=None, finite=None)

    step.close = engine.free_memory  # type: ignore[attr-defined]  # DeepSpeed's engines outlive a dropped reference
    return step


def _make(way: str, numel: int) -> Callable[[], None] | None:
    torch.manual_seed(0)
    model = _model(numel)
    if way == "plain":
        return _plain_way(model)
    if way == "foreach":
        return _plain_way(model, foreach=True)
    if way == "fused":
        return _plain_way(model, fused=True)
    try:
        if way == "ds_cpu_adam":
            return _ds_cpu_adam(model)
        if way == "deepspeed":
            return _deepspeed(model)
        if way == "shardwise_dsk":
            return _shardwise(model, "torch", kernel="deepspeed")
        return _shardwise(model, "torch" if way == "shardwise" else "deepspeed")
    except ImportError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[50, 200], help="millions of elements")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per way and round")
    ap.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # one process, as torchrun would describe it; one gloo group that every way joins
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    results: dict[str, Any] = {}
    for size in args.sizes:
        side, layers = _shape(int(size * 10**6))
        numel = side * side * layers
        times: dict[str, list[list[float]]] = {}
        for r in range(args.rounds):
            for way in (args.ways if r % 2 == 0 else args.ways[::-1]):
                step = _make(way, numel)
                if step is None:
                    continue
                step()  # warm: state allocated, kernels chosen
                ts = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    ts.append(time.perf_counter() - t0)
                times.setdefault(way, []).append(ts)
                if hasattr(step, "close"):  # the ways on an engine: the next round's would pile up
                    step.close()
                del step
                gc.collect()
        med = {w: statistics.median(t for ts in rounds for t in ts) for w, rounds in times.items()}
        rows: dict[str, dict[str, Any]] = {}
        for w, rounds in times.items():
            per_round = [statistics.median(ts) for ts in rounds]
            # microseconds kept: a small size's fused step takes ~0.05 ms (0.0 at one decimal)
            rows[w] = {"ms": round(med[w] * 1e3, 3), "spread_ms": [round(min(per_round) * 1e3, 3),
                                                                   round(max(per_round) * 1e3, 3)],
                       "elements_per_s": round(numel / med[w] / 1e6, 1)}
            for ref in ("ds_cpu_adam", "deepspeed"):
                if ref in med:
                    rows[w][f"vs_{ref}"] = round(med[ref] / med[w], 2)
        results[f"{size:g}M"] = {"numel": numel, "ways": rows}
        print(f"{numel / 1e6:.1f}M elements, {threads} thread(s), {args.rounds} rounds x {args.steps} steps "
              "(median, spread of the round medians):")
        for w, row in rows.items():
            lo, hi = row["spread_ms"]
            line = f"  {w:13s} {row['ms']:8.1f} ms ({lo:.0f}-{hi:.0f})"
            line += f"  {row['elements_per_s']:8.1f} M elements/s"
            if "vs_ds_cpu_adam" in row:
                line += f"  {row['vs_ds_cpu_adam']:.2f}x DeepSpeedCPUAdam"
            if "vs_deepspeed" in row:
                line += f"  {row['vs_deepspeed']:.2f}x DeepSpeed's offload step"
            print(line)
    from common import RESULTS, write_report

    payload = {"command": "python benchmarks/host_optimizer.py " + " ".join(sys.argv[1:]), "threads": threads,
               "rounds": args.rounds, "steps": args.steps, "results": results}
    path = write_report("host_optimizer", payload, args.out or RESULTS)
    print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
