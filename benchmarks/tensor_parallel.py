"""Tensor parallelism against ZeRO alone: per-rank memory, bytes per collective, step time.

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/tensor_parallel.py

A Llama-shaped transformers model (its own tensor-parallel plan) trained on 4 processes with one
global batch (8 sequences of 128 tokens, AdamW, fp32), as:
  ddp           4 replicas;
  zero3         sharded over 4 data-parallel ranks;
  dp2 x tp2     zero3 over 2 data-parallel ranks, each layer split over a pair (tensor_parallel_size 2);
  tp4           each layer split over all 4 (one data-parallel rank);
  ... + sp      the same with sequence parallelism (sequence_parallel: the activations between the
                split layers split over the sequence too).
For each: the median step time over `--steps` steps (after 2 warm-up steps), this rank's tensor
bytes by role after an optimizer step (`engine.memory_report()`: parameters, gradients,
optimizer state), the bytes autograd saves for backward in one forward (each storage once: the
activations a step holds at its peak, weights it saves included), and the bytes
each collective kind moved in one step, counted as the tensors passed to the collective ops
(c10d's and DTensor's functional ones, seen by a TorchDispatchMode): the input of an all-reduce,
the gathered output of an all-gather, the input of a reduce-scatter. Rank 0 prints the table and
writes benchmarks/results/tensor_parallel-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish_distributed

import shardwise

CASES = {"ddp": ("ddp", 1, False), "zero3": ("zero3", 1, False), "dp2 x tp2": ("zero3", 2, False),
         "dp2 x tp2 + sp": ("zero3", 2, True), "tp4": ("zero3", 4, False), "tp4 + sp": ("zero3", 4, True)}
KINDS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
         "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}


class CollectiveBytes(TorchDispatchMode):
    """Bytes passed to collective ops (c10d and functional collectives), by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.name())
        if name.startswith(("c10d::", "_c10d_functional::")):
            kind = next((v for k, v in KINDS.items() if k in name.split("::")[1]), None)
            if kind is not None:
                tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
                # an all-gather's first tensor is its output buffer(s) (c10d) or its input (functional);
                # c10d's list forms pass their parts: all the outputs (all-gather), inputs (reduce-scatter)
                op = name.split("::")[1].split(".")[0]
                parts = args[0] if op == "allgather_" else args[1] if op == "reduce_scatter_" else None
                counted = tensors[:1] if parts is None else [
                    a for a in torch.utils._pytree.tree_leaves(parts) if isinstance(a, torch.Tensor)]
                size = sum(t.numel() * t.element_size() for t in counted)
                if kind == "all_gather" and name.startswith("_c10d_functional::"):
                    size *= dist.get_world_size()  # (its group's size at most: an upper bound)
                self.bytes[kind] += size
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))


def llama(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def measure(case: str, args: argparse.Namespace) -> dict[str, Any]:
    strategy, tp, sp = CASES[case]
    engine = shardwise.Engine(preempt_signals=(),
                              strategy=strategy, cpu=args.device == "cpu", seed=0, tensor_parallel_size=tp,
                              sequence_parallel=sp, progress=False)
    model = llama(args.hidden, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)
    dp = engine.num_processes // tp
    g = torch.Generator().manual_seed(engine.process_index // tp)  # a tp group: one batch
    batches = [torch.randint(0, 4096, (args.global_batch // dp, 128), generator=g).to(engine.device)
               for _ in range(2)]

    held: list[Any] = []

    def step(i: int) -> None:
        engine.backward(loss_of(model, batches[i % 2]))
        engine.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        held[:] = [engine.memory_report()]  # after the step, gradients still held
        opt.zero_grad()

    for i in range(2):
        step(i)
    with shardwise.SavedActivations() as saved:  # (each storage once, a DTensor's local one)
        loss = loss_of(model, batches[0])
    del loss
    counted = CollectiveBytes()
    with counted:
        step(0)
    times = []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(i)
        if torch.cuda.is_available() and args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    report = held[0]
    engine.free_memory()
    roles = {"params": report.params, "grads": report.grads, "optimizer": report.optimizer}
    roles["saved"] = float(saved.total)
    return {"step_s": statistics.median(times), "mib": {k: round(v / 2**20, 2) for k, v in roles.items()},
            "collective_mib": {k: round(v / 2**20, 3) for k, v in sorted(counted.bytes.items())},
            "collective_calls": dict(sorted(counted.calls.items())), "dp": dp, "tp": tp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per process")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = {case: measure(case, args) for case in args.cases}
    if dist.get_rank() == 0:
        print(f"{'case':14s} {'step s':>7s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'saved':>7s}  "
              "collectives (MiB per step)")
        for case, r in results.items():
            mib = r["mib"]
            comm = ", ".join(f"{k} {v:.2f} ({r['collective_calls'][k]} calls)"
                             for k, v in r["collective_mib"].items())
            print(f"{case:14s} {r['step_s']:7.3f} {mib.get('params', 0):7.2f} {mib.get('grads', 0):7.2f} "
                  f"{mib.get('optimizer', 0):7.2f} {mib.get('saved', 0):7.2f}  {comm}")
    finish_distributed("tensor_parallel", {"model": f"Llama d{args.hidden} L{args.layers} vocab4096 seq128",
                                           "global_batch": args.global_batch, "steps": args.steps,
                                           "results": results}, args.out)


if __name__ == "__main__":
    main()
