"""Mixture-of-experts: expert parallelism against ZeRO-3 alone, at 4 processes.

    python benchmarks/moe.py [--processes 4] [--eps 1 2 4] [--steps 3]

A Mixtral-shaped transformers model (hidden 128, 8 experts of intermediate 512, top 2, 2 layers,
4 query / 2 key-value heads, vocabulary 1024, fp32, AdamW) trains batches of 2 x 128 tokens per
process under zero3 with `expert_parallel_size` 1 (ZeRO-3 alone: every rank all-gathers every
expert of every layer), 2 (ep 2 x data 2) and 4. For each, on rank 0:
  expert_mib      the expert parameters this rank holds between steps (measured: local elements);
  params_mib      every parameter this rank holds between steps (memory_report().params);
  a2a_mib         bytes the expert all-to-alls sent to other ranks in one step (measured at the
                  exchange: tokens out, results back, forward and backward);
  gather_mib      bytes of expert weights this rank receives from all-gathers in one step
                  (derived: zero3 gathers each expert tensor it shards in forward and again in
                  backward, receiving (G-1)/G of it each time over its G ranks: all of them under
                  ZeRO-3 alone, the processes / ep that hold the same experts under ep, none at
                  ep = processes);
  step_s          the median step time over --steps steps after a warm-up.
The script launches itself under torchrun (the driver), then prints the table and writes
benchmarks/results/moe-<hardware>-<date>.json. `--device cuda`: one GPU per process
(benchmarks/gpu_session.sh runs it at 4 processes where there are 4 GPUs). On this 2-core
machine 4 processes share 2 cores: compare bytes, not time.
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

SEQ, BATCH, VOCAB, EXPERTS = 128, 2, 1024, 8


def mixtral(hidden: int, intermediate: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False))


def one_layout(ep: int, args: argparse.Namespace) -> dict[str, Any]:
    import shardwise
    from shardwise.strategies.expert_parallel import sent_bytes

    engine = shardwise.Engine(preempt_signals=(),
                              strategy="zero3", cpu=args.device == "cpu", seed=0, expert_parallel_size=ep,
                              progress=False)
    model = mixtral(args.hidden, args.intermediate)
    full_experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)
    world = engine.num_processes
    g = torch.Generator().manual_seed(1 + engine.process_index)
    times, sent = [], 0
    for i in range(args.steps + 1):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(engine.device)
        sent_bytes()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
        sent = sent_bytes()
    held = sum(p.to_local().numel() * p.element_size()
               for n, p in model.named_parameters() if ".experts." in n)
    edp = world // ep  # the ranks that hold the same experts and shard them (ZeRO-3 alone: all)
    gather = 2 * (full_experts / ep) * (edp - 1) / edp
    row = {"ep": ep, "expert_mib": held / 2**20, "params_mib": engine.memory_report().params / 2**20,
           "a2a_mib": sent / 2**20, "gather_mib": gather / 2**20, "step_s": statistics.median(times),
           "loss": float(loss.detach())}
    engine.free_memory()
    return row


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rows = [one_layout(ep, args) for ep in args.eps]
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: one GPU per process (gpu_session.sh runs it where there are 4)")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.worker_out:
        worker(args)
        return
    rows = run_under_torchrun(__file__, args.processes, [
        "--steps", str(args.steps), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
        "--device", args.device, "--eps", *map(str, args.eps)])
    print(f"{args.processes} processes, zero3, rank 0 (MiB; step seconds)")
    print(f"{'layout':<16}{'experts':>9}{'params':>9}{'a2a':>9}{'gathers':>9}{'step s':>9}")
    for r in rows:
        name = "zero3 alone" if r["ep"] == 1 else f"zero3 + ep {r['ep']}"
        print(f"{name:<16}{r['expert_mib']:>9.2f}{r['params_mib']:>9.2f}{r['a2a_mib']:>9.2f}"
              f"{r['gather_mib']:>9.2f}{r['step_s']:>9.3f}")
    payload = {"processes": args.processes, "device": args.device, "hidden": args.hidden,
               "intermediate": args.intermediate, "experts": EXPERTS, "seq": SEQ, "batch": BATCH,
               "rows": rows}
    path = write_report("moe", payload, **({"out": args.out} if args.out else {}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
