"""Is `shardwise plan` right on a real GPU? Predicted largest batch vs the largest that runs.

    python benchmarks/plan_gpu.py --models gpt2-large gpt2-xl --seq-len 128 --gpu-memory 24GB

For each model and strategy the planner predicts the largest per-device batch P on a card of
`--gpu-memory` (one process). The GPU is then capped to that card with
torch.cuda.set_per_process_memory_fraction (the caching allocator's limit: the card minus the
CUDA context this process really has, measured) and training steps of the very model, batch
and loss the planner traced are run at P+1, P and P-1 (and P+2 when P+1 fits) until the real
largest batch M is pinned down; the check passes when |M - P| <= 1. Each trial is a fresh
Engine and model, two optimizer steps (the second holds the optimizer state), so the peak of a
steady step is reached. Results: one JSON (to --out) and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shardwise
from shardwise.config import plan_choices
from shardwise.plan import Overheads, PlanRequest, parse_memory, plan_named, resolve_model

_CONTEXT_PROBE = """
import torch
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
(x @ x).float().sum().backward()  # load cuBLAS and its workspace, as training does
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(total - free - torch.cuda.memory_reserved())
"""
SETUPS = plan_choices("torch")  # every (strategy, offload) pair the strategy table allows


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch.to(device) if isinstance(batch, torch.Tensor) else batch


def trial(spec: Any, strategy: str, offload: str, batch: int, precision: str) -> tuple[bool, int]:
    """Two training steps at `batch`: (it ran, the allocator's peak bytes)."""
    torch.cuda.reset_peak_memory_stats()
    ok = True
    try:
        engine = shardwise.Engine(preempt_signals=(),
                                  strategy=strategy, offload=offload, precision=precision, seed=0)
        with torch.device(engine.device):
            model = spec.build(None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        model, opt = engine.prepare(model, opt)
        out = None
        for _ in range(2):
            data = _to(spec.make_batch(batch), engine.device)
            # the previous output lives until here
            out = model(**data) if isinstance(data, dict) else model(data)
            engine.backward(spec.loss_fn(out, data))
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        ok = False
    peak = torch.cuda.max_memory_allocated()
    model = opt = out = engine = data = None
    gc.collect()
    torch.cuda.empty_cache()
    return ok, peak


def real_max(
    spec: Any, strategy: str, offload: str, p: int, precision: str, log: list[dict[str, Any]]
) -> int | str:
    """The largest batch that runs, searched around the prediction `p`."""
    def fits(b: int) -> bool:
        t0 = time.perf_counter()
        ok, peak = trial(spec, strategy, offload, b, precision)
        log.append({"batch": b, "ran": ok, "peak_gib": round(peak / 2**30, 2),
                    "seconds": round(time.perf_counter() - t0, 1)})
        print(f"    {strategy}+{offload} batch {b}: {'ran' if ok else 'OOM'} "
              f"(allocator peak {peak / 2**30:.2f} GiB)", flush=True)
        return ok

    if fits(p + 1):
        return p + 1 if not fits(p + 2) else f">={p + 2}"
    if p == 0:
        return 0
    if fits(p):
        return p
    if p == 1:
        return 0
    return p - 1 if fits(p - 1) else f"<={p - 2}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2-large", "gpt2-xl"])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--precision", default="fp32",
                    help="fp32 by default: the trace applies CPU autocast rules")
    ap.add_argument("--setups", nargs="+", default=[f"{s}+{o}" for s, o in SETUPS])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("plan_gpu: needs a GPU")
    budget = parse_memory(args.gpu_memory, "--gpu-memory")
    # The CUDA context is measured in a child process, and every model is planned before this
    # process touches CUDA: the planner forks its tracing workers, which a process that has run
    # autograd on CUDA cannot do.
    context = int(subprocess.run([sys.executable, "-c", _CONTEXT_PROBE], check=True, capture_output=True,
                                 text=True).stdout.split()[-1])
    plans = {}
    for name in args.models:
        t0 = time.perf_counter()
        # the planner's CUDA-context term set to what was measured (a stated, overridable term)
        request = PlanRequest(world_size=1, device_memory=args.gpu_memory, precision=args.precision,
                              device="cuda", activation_checkpointing=False,
                              overheads=Overheads(cuda_context=context), workers=4)
        plans[name] = plan_named(name, request, seq_len=args.seq_len)
        best = plans[name].best
        print(f"{name}: planned in {time.perf_counter() - t0:.1f} s; best {best.name if best else None}",
              flush=True)
    shardwise.Engine(preempt_signals=(),
                     seed=0)  # the process group every trial shares; also creates the CUDA context
    _, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction((budget - context) / total)
    print(f"card {budget / 2**30:.1f} GiB = CUDA context {context / 2**30:.2f} GiB (measured) + "
          f"allocator cap {(budget - context) / 2**30:.2f} GiB; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}",
          flush=True)
    rows: list[dict[str, Any]] = []
    report = {"command": "python benchmarks/plan_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "budget": args.gpu_memory,
              "measured_cuda_context_gib": round(context / 2**30, 3), "precision": args.precision,
              "seq_len": args.seq_len, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        plan = plans[name]
        spec = resolve_model(name, args.seq_len)
        for setup in args.setups:
            strategy, _, offload = setup.partition("+")
            sp = plan.find(strategy, offload or "none")
            log: list[dict[str, Any]] = []
            real = real_max(spec, strategy, offload or "none", sp.max_batch, args.precision, log)
            row = {"model": name, "setup": setup, "predicted": sp.max_batch, "real": real,
                   "within_1": isinstance(real, int) and abs(real - sp.max_batch) <= 1,
                   "predicted_peak_gib_at_batch1": round(sp.peak / 2**30, 2), "trials": log}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
            (args.out / "plan_gpu.json").write_text(json.dumps(report, indent=1))
    print("\n| model | setup | predicted max batch | largest batch that ran | within +-1 |\n"
          "|---|---|---|---|---|")
    for r in rows:
        within = "yes" if r["within_1"] else "NO"
        print(f"| {r['model']} | {r['setup']} | {r['predicted']} | {r['real']} | {within} |")
    return 0 if all(r["within_1"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
