"""shardwise against raw PyTorch, Hugging Face Accelerate and DeepSpeed, side by side, in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/compare.py

Every peer trains the same GPT (same seed, data, AdamW, clipping, steps) for each strategy asked:
  shardwise   Engine(strategy=...)
  raw         the loop an expert writes: DDP for ddp/zero1, FSDP2 fully_shard per block for zero2/3
  accelerate  Accelerator with its closest configuration (DDP, or an FSDP2 plugin)
  deepspeed   deepspeed.initialize with ZeRO stage 0-3 and a torch AdamW
It reports the median step time, tokens/s, per-rank tensor memory and the final loss, and writes
JSON, a markdown table and (with matplotlib) a PNG chart to benchmarks/results/. It also checks
what each peer really ran -- the wrapper it returned and whether the ranks' weights still agree
after training -- because Accelerate cannot shard on CPU and silently falls back.

Memory is counted the same way for every peer, per rank, in tensor bytes, each storage once:
  state        all live tensor storages after an optimizer step (walking the garbage
               collector's objects; DTensor shards by their local storage), minus what was alive
               before the peer was built: parameters, gradients, optimizer state, flat buffers;
  activations  the storages autograd saves for backward during one step (saved-tensor hooks),
               gathered parameters included, minus those already counted as state;
  peak         state + activations (an upper estimate: both are taken at their largest).
DeepSpeed's bucket sizes are set to 5M elements (its 500M defaults would add ~2 GB of buffers
to this small model).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, RESULTS, hardware, lm_loss, write_report

import shardwise
from shardwise.config import offload_spec, strategy_spec  # what each name means, for the peers
from shardwise.distributed.internals import local_tensor  # a DTensor's shard, without an autograd node

MODEL = {"vocab": 4096, "d": 256, "layers": 4, "heads": 4, "block": 128}


def storages() -> dict[tuple[str, int], int]:
    """Every live tensor storage in this process: (device, address) -> bytes."""
    out: dict[tuple[str, int], int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on some lazy module objects warns
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if not isinstance(obj, torch.Tensor):
            continue
        t = local_tensor(obj)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if t.device.type != "meta" and st.nbytes():
            out[(str(st.device), st.data_ptr())] = st.nbytes()
    return out


class Peer:
    """One training setup: `step(ids) -> loss`, plus what it really is."""

    def __init__(
        self,
        name: str,
        step: Callable[[torch.Tensor], torch.Tensor],
        ran: str,
        params: Callable[[], Any],
        close: Callable[[], Any] | None = None,
    ) -> None:
        self.name, self.step, self.ran, self.params = name, step, ran, params
        self.close = close  # what releases the peer beyond dropping it (DeepSpeed's engines)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(**MODEL)


def shardwise_peer(strategy: str, offload: str, backend: str = "torch", **engine_kw: Any) -> Peer:
    engine = shardwise.Engine(preempt_signals=(),
                              strategy=strategy, offload=offload, backend=backend, seed=0, **engine_kw)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)

    def step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()  # at the start, so the gradients are still alive when memory is sampled
        loss = lm_loss(model, ids)
        engine.backward(loss)
        engine.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    def params() -> Any:
        if backend == "deepspeed":  # whole fp32 weights on every rank (ZeRO-3 empties the module's)
            return list(engine.session.strategy.model_state(model).values())
        return engine.unwrap_model(model).parameters()

    fsdp = strategy_spec(strategy).shards_grads  # stages 2 and 3: the module FSDP wraps in place
    ran = f"{type(engine.unwrap_model(model)).__name__ if fsdp else type(model).__name__}"
    return Peer("shardwise", step, f"{strategy}{'+' + offload if offload_spec(offload).any else ''} ({ran})",
                params, close=engine.free_memory)


def raw_peer(strategy: str, device: torch.device) -> Peer:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = _model().to(device)
    spec = strategy_spec(strategy)
    if not spec.shards_grads:  # ddp, zero1: whole gradients on every rank
        model = DistributedDataParallel(model)
        ran = "DistributedDataParallel"
    else:
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=spec.shards_params)
        fully_shard(model, reshard_after_forward=spec.shards_params)
        ran = f"FSDP2 fully_shard (reshard_after_forward={spec.shards_params})"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = lm_loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return Peer("raw", step, ran, model.parameters)


def accelerate_peer(strategy: str) -> Peer:
    from accelerate import Accelerator

    kwargs: dict[str, Any] = {"cpu": not torch.cuda.is_available()}
    asked = "DDP"
    spec = strategy_spec(strategy)
    if spec.shards_grads:
        from accelerate import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=spec.shards_params
        )
        asked = "FSDP2"
    acc = Accelerator(**kwargs)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)

    def step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = lm_loss(model, ids)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    ran = (
        f"asked {asked}; got {type(model).__name__} ({acc.distributed_type}, "
        f"{acc.num_processes} process(es))"
    )
    return Peer("accelerate", step, ran, lambda: acc.unwrap_model(model).parameters())


def deepspeed_peer(strategy: str, offload: str, batch: int) -> Peer:
    import deepspeed

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # DeepSpeed's default buckets (5e8 elements) would allocate ~2 GB of buffers for this small
    # model and swamp the comparison: size them like the model instead.
    zero: dict[str, Any] = {
        "stage": strategy_spec(strategy).stage,
        "reduce_bucket_size": 5e6,
        "allgather_bucket_size": 5e6,
        "stage3_prefetch_bucket_size": 5e6,
    }
    if offload_spec(offload).optimizer_on_host:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_spec(offload).params_on_host:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    engine, _ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(engine, ids)
        engine.backward(loss)
        engine.step()
        return loss

    ran = f"ZeRO stage {zero['stage']}{' + offload ' + offload if offload_spec(offload).any else ''}"
    return Peer("deepspeed", step, ran, engine.module.parameters, close=engine.destroy)


def weights_agree(params: Any) -> bool:
    """True when every rank holds the same (full) weights: the run was really synchronized."""
    flat = torch.cat(
        [(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).float() for p in params]
    )
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool((high - low).abs().max() < 1e-6)


def measure(make: Callable[[], Peer], batches: list[torch.Tensor], warmup: int) -> dict[str, Any]:
    gc.collect()
    before = storages()
    peer = make()
    times, losses, state, saved = [], [], 0, 0
    for i, ids in enumerate(batches):
        if i == warmup:  # once the optimizer has state: count what autograd keeps for backward
            kept: dict[tuple[str, int], int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                local = local_tensor(t)
                st = local.untyped_storage()
                kept[(str(st.device), st.data_ptr())] = st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = peer.step(ids)
            now = storages()
            state = sum(v for k, v in now.items() if k not in before)
            saved = sum(v for k, v in kept.items() if k not in now and k not in before)
            losses.append(loss.item())
            continue
        dist.barrier()
        t0 = time.perf_counter()
        loss = peer.step(ids)
        elapsed = time.perf_counter() - t0
        if i > warmup:
            times.append(elapsed)
        losses.append(loss.item())
    synced = weights_agree(list(peer.params()))
    if peer.close is not None:
        peer.close()
    result = {
        "peer": peer.name,
        "ran": peer.ran,
        "median_step_s": statistics.median(times),
        "step_times": times,
        "final_loss": losses[-1],
        "state_mib": round(state / 2**20, 2),
        "activations_mib": round(saved / 2**20, 2),
        "tensor_mib": round((state + saved) / 2**20, 2),
        "weights_agree_across_ranks": synced,
    }
    del peer
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=["ddp", "zero2", "zero3"])
    ap.add_argument("--peers", nargs="+", default=["shardwise", "raw", "accelerate", "deepspeed"])
    ap.add_argument(
        "--offload", default="none", help="offload for shardwise and deepspeed (none, optimizer, params)"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.steps < args.warmup + 2:
        ap.error(f"--steps {args.steps} leaves no timed step: it needs at least --warmup + 2 "
                 f"({args.warmup + 2}; one more step samples memory)")

    shardwise.Engine(preempt_signals=(), seed=0)  # joins the process group every peer shares
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, MODEL["vocab"], (args.batch_size, MODEL["block"] + 1), generator=g).to(device)
               for _ in range(args.steps)]
    tokens_per_step = args.batch_size * MODEL["block"] * world

    def offload_for(s: str) -> str:  # offload needs sharded optimizer states: ddp runs without it
        return args.offload if strategy_spec(s).shards_optimizer else "none"

    makers: dict[str, Callable[[str], Peer]] = {
        "shardwise": lambda s: shardwise_peer(s, offload_for(s)),
        "raw": lambda s: raw_peer(s, device),
        "accelerate": accelerate_peer,
        "deepspeed": lambda s: deepspeed_peer(s, offload_for(s), args.batch_size),
    }
    rows = []
    for strategy in args.strategies:
        for name in args.peers:
            try:
                row = measure(lambda: makers[name](strategy), batches, args.warmup)
            except ImportError as err:
                row = {"peer": name, "ran": f"not installed ({err.name})", "median_step_s": None}
            row["strategy"] = strategy
            if row.get("median_step_s"):
                row["tokens_per_s"] = round(tokens_per_step / row["median_step_s"], 1)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        write_outputs(rows, args, world)
    dist.barrier()
    dist.destroy_process_group()


def write_outputs(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    import datetime

    date = datetime.date.today().isoformat()
    stem = f"compare-{hardware()}-{date}"
    path = write_report("compare", {
        "command": "python -m torch.distributed.run --standalone --nproc-per-node "
                   f"{world} benchmarks/compare.py " + " ".join(sys.argv[1:]),
        "world_size": world, "model": f"GPT {MODEL}", "batch_per_rank": args.batch_size,
        "steps": args.steps, "warmup": args.warmup, "rows": rows,
    }, args.out)
    lines = [
        "| strategy | peer | ran | median ms/step | tokens/s | peak MiB/rank (state + activations) "
        "| final loss | ranks agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("median_step_s"):
            lines.append(f"| {r['strategy']} | {r['peer']} | {r['ran']} | - | - | - | - | - |")
            continue
        lines.append(f"| {r['strategy']} | {r['peer']} | {r['ran']} | {r['median_step_s'] * 1e3:.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tensor_mib']} "
                     f"({r['state_mib']} + {r['activations_mib']}) | {r['final_loss']:.4f} | "
                     f"{'yes' if r['weights_agree_across_ranks'] else 'NO'} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    done = [r for r in rows if r.get("median_step_s")]
    labels = [f"{r['strategy']} {r['peer']}" for r in done]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, len(done) * 0.9), 4.5))
    a.bar(labels, [r["tokens_per_s"] for r in done], color="tab:blue")
    a.set_title("tokens/s (higher is better)")
    b.bar(labels, [r["tensor_mib"] for r in done], color="tab:orange")
    b.set_title("peak tensor MiB per rank (lower is better)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7, labelrotation=60)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=110)
    print(f"wrote {path}, {stem}.md, {stem}.png")


if __name__ == "__main__":
    main()
