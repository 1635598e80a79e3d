"""Long context: the longest sequence that trains under a fixed activation budget, one process
against context parallelism over 2 and 4 processes, ring and Ulysses.

    python benchmarks/long_context.py [--cap-mib 48] [--lengths 1024 2048 4096 8192]

A Llama-shaped transformers model (hidden 128, 2 layers, 4 query / 2 key-value heads, vocabulary
2048, fp32, AdamW, zero3) trains one sequence per step at each length, as
  1 process           plain (no tiling) and with tiled MLP and loss (tile_tokens 256);
  cp 2, cp 4          context_parallel_size 2 and 4 (one data-parallel rank), ring and Ulysses,
                      tiled MLP and loss on (their default under context parallelism).
For each: the bytes autograd saves in one forward on rank 0 (each storage once: the activations a
step holds for backward, the weights it saves included), measured at every length; the longest
length whose saved bytes stay within --cap-mib; the median step time over 2 steps after a warm-up,
at the shortest length every layout runs. The script launches itself under torchrun once per
process count (the driver), then prints the table and writes
benchmarks/results/long_context-<hardware>-<date>.json. On this 2-core machine the 4-process
rows share 2 cores: compare their memory, not their time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_under_torchrun, write_report

LAYOUTS = {1: [("none", False), ("none", True)], 2: [("ring", True), ("ulysses", True)],
           4: [("ring", True), ("ulysses", True)]}


def llama(seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg)


def one_layout(method: str, tiled: bool, seq: int, steps: int, device: str) -> dict[str, Any]:
    import shardwise

    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra: dict[str, Any] = {"context_parallel_size": world, "context_parallel": method} if world > 1 else {}
    engine = shardwise.Engine(preempt_signals=(),
                              strategy="zero3", cpu=device == "cpu", seed=0, tiled_mlp=tiled,
                              tiled_loss=tiled, tile_tokens=256, **extra)
    model = llama(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)
    ids = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(1)).to(engine.device)
    try:
        return _steps(engine, model, opt, ids, steps)
    except torch.cuda.OutOfMemoryError:  # the whole device is not enough at this length
        engine.free_memory()
        return {"saved": None, "step_s": None, "loss": None, "out_of_memory": True}


def _steps(engine: Any, model: Any, opt: Any, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    import shardwise

    times, saved = [], 0
    for i in range(steps + 1):
        _sync(engine.device)  # (on a GPU the clock is read once its queued work is done)
        start = time.perf_counter()
        with shardwise.SavedActivations() as seen:
            loss = model(input_ids=ids, labels=ids).loss
        saved = saved or seen.total
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        _sync(engine.device)
        if i:
            times.append(time.perf_counter() - start)
    engine.free_memory()
    return {"saved": saved, "step_s": statistics.median(times), "loss": float(loss.detach())}


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work: a CUDA step returns before its kernels end, so a clock
    read without it times the launches, not the step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = []
    for method, tiled in LAYOUTS[world]:
        for seq in args.lengths:
            r = one_layout(method, tiled, seq, args.steps if seq == min(args.lengths) else 1, args.device)
            rows.append({"processes": world, "method": method, "tiled": tiled, "seq": seq, **r})
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


def _mib(saved: int | None) -> str:
    """A table cell: MiB saved, or OOM where the device ran out of memory at that length."""
    return f"{'OOM':>9}" if saved is None else f"{saved / 2**20:>9.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-mib", type=float, default=48.0)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per process")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.worker_out:
        worker(args)
        return
    rows: list[dict[str, Any]] = []
    for n in args.processes:
        rows += run_under_torchrun(__file__, n, ["--steps", str(args.steps), "--device", args.device,
                                                 "--lengths", *map(str, args.lengths)])
    cap = args.cap_mib * 2**20
    print(f"activation bytes saved per rank in one forward (MiB), cap {args.cap_mib:g} MiB")
    print(f"{'layout':<26}" + "".join(f"{s:>9}" for s in args.lengths) + f"{'longest':>9}{'step s':>9}")
    summary = []
    for n in args.processes:
        for method, tiled in LAYOUTS[n]:
            mine = [r for r in rows if r["processes"] == n and r["method"] == method and r["tiled"] == tiled]
            name = f"{n} process" + ("es" if n > 1 else "") + (f" {method}" if n > 1 else "") + \
                (" tiled" if tiled else "")
            fits = [r["seq"] for r in mine if r["saved"] is not None and r["saved"] <= cap]
            longest = max(fits) if fits else 0
            first = min(mine, key=lambda r: r["seq"])
            print(f"{name:<26}" + "".join(_mib(r["saved"]) for r in mine) +
                  f"{longest:>9}{first['step_s'] or 0:>9.2f}")
            summary.append({"layout": name, "longest_within_cap": longest,
                            "saved_mib": {r["seq"]: r["saved"] and round(r["saved"] / 2**20, 2)
                                          for r in mine},
                            "step_s_at_shortest": first["step_s"] and round(first["step_s"], 3),
                            "loss_at_shortest": first["loss"]})
    payload = {"cap_mib": args.cap_mib, "lengths": args.lengths, "rows": rows, "summary": summary}
    path = write_report("long_context", payload, **({"out": args.out} if args.out else {}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
