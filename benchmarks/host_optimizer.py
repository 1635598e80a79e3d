"""The host optimizer step of CPU offload, in elements per second, side by side in one run.

    python benchmarks/host_optimizer.py                    # 50M and 200M elements, 5 rounds
    python benchmarks/host_optimizer.py --sizes 50 --rounds 3

One process, fp32 AdamW over N elements with gradients present; each round times one step of
each way, in alternating order; the figure is the best of the rounds (steps are deterministic
work, so the fastest is the least disturbed):
  plain          torch.optim.AdamW(params), as users write it (the single-tensor loop on CPU)
  foreach        the same with foreach=True
  fused          the same with fused=True (torch's fused CPU kernel)
  ds_cpu_adam    DeepSpeed's DeepSpeedCPUAdam (what DeepSpeed's offload swaps in), if installed
  shardwise      shardwise's optimizer-offload step on the torch backend (zero2 + offload
                 "optimizer"): the user's plain AdamW, stepped by the runner on host masters,
                 including the gradient copies into the host buffers and the parameter copies back
  shardwise_ds   the same on backend="deepspeed" (DeepSpeed ZeRO-2 with optimizer offload)
Threads: each way runs with the threads this process may use (torch.get_num_threads() is set to
the CPUs in its affinity mask for the run), as an offload step would.
Writes benchmarks/results/host_optimizer-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
WAYS = ["plain", "foreach", "fused", "ds_cpu_adam", "shardwise", "shardwise_ds"]


SIDE = 4096


def _layers(numel: int) -> int:
    return max(1, round(numel / SIDE**2))


def _model(numel: int) -> nn.Module:
    """Square linears (no bias) holding about `numel` elements in all."""
    return nn.Sequential(*(nn.Linear(SIDE, SIDE, bias=False) for _ in range(_layers(numel))))


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


def _shardwise(model: nn.Module, backend: str) -> Callable[[], None]:
    import shardwise

    engine = shardwise.Engine(strategy="zero2", offload="optimizer", backend=backend, cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # as users write it
    model, opt = engine.prepare(model, opt)
    runner = opt.runner
    grads = [torch.randn_like(p) * 1e-3 for p in runner.params()]

    def step() -> None:
        for p, g in zip(runner.params(), grads, strict=True):
            p.grad = g
        engine.session.strategy.optimizer_step(runner, clip=None, finite=None)

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
        return _shardwise(model, "torch" if way == "shardwise" else "deepspeed")
    except ImportError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[50, 200], help="millions of elements")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ways", nargs="+", default=WAYS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # one process, as torchrun would describe it (DeepSpeed insists on LOCAL_RANK)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    results: dict[str, Any] = {}
    for size in args.sizes:
        numel = _layers(size * 10**6) * SIDE**2
        best: dict[str, float] = {}
        for r in range(args.rounds):
            for way in (args.ways if r % 2 == 0 else args.ways[::-1]):
                step = _make(way, size * 10**6)
                if step is None:
                    continue
                step()  # warm: state allocated, kernels chosen
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                best[way] = min(best.get(way, dt), dt)
                del step
                gc.collect()
        rows = {w: {"ms": round(best[w] * 1e3, 1), "elements_per_s": round(numel / best[w] / 1e6, 1)} for w in best}
        if "ds_cpu_adam" in best:
            for w, row in rows.items():
                row["vs_ds_cpu_adam"] = round(best["ds_cpu_adam"] / best[w], 2)
        results[f"{size}M"] = {"numel": numel, "ways": rows}
        print(f"{numel / 1e6:.0f}M elements, {threads} thread(s), best of {args.rounds} rounds:")
        for w, row in rows.items():
            print(f"  {w:13s} {row['ms']:8.1f} ms  {row['elements_per_s']:8.1f} M elements/s"
                  + (f"  {row['vs_ds_cpu_adam']:.2f}x DeepSpeedCPUAdam" if "vs_ds_cpu_adam" in row else ""))
    from common import write_report

    payload = {"command": "python benchmarks/host_optimizer.py " + " ".join(sys.argv[1:]), "threads": threads,
               "results": results}
    path = write_report("host_optimizer", payload, args.out) if args.out else write_report("host_optimizer", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
