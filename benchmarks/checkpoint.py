"""Checkpoint save/load time and size for a ~100M-parameter GPT on 2 processes, in one run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/checkpoint.py

Measures `save_state` (sharded: model + AdamW state), `load_state` into a fresh engine,
`save_model` (consolidated safetensors) and the offline `shardwise export`, for each strategy
asked, and the cost of the checksums inside them: at save, each process hashing the files it
wrote (`storage.checksum_file`, as `save_state` does right after writing them); at load, the
verification `load_state` runs first (`checkpoint.verify_files`, each process a share of the
files); in seconds per GB. Writes benchmarks/results/checkpoint-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GPT, finish_distributed, lm_loss

import shardwise
from shardwise import cli
from shardwise.checkpoint import sharded as checkpoint
from shardwise.checkpoint.storage import checksum_file


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(strategy: str) -> tuple[shardwise.Engine, torch.nn.Module, torch.optim.Optimizer]:
    engine = shardwise.Engine(preempt_signals=(), strategy=strategy, seed=0)
    model = GPT(vocab=32000, d=768, layers=12, heads=12, block=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = engine.prepare(model, opt)
    return engine, model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=["zero3", "ddp"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = {}
    for strategy in args.strategies:
        engine, model, opt = build(strategy)
        ids = torch.randint(0, 32000, (1, 65))
        engine.backward(lm_loss(model, ids))
        opt.step()  # so AdamW has its state
        root = Path(tempfile.mkdtemp(prefix="shardwise-bench-")) if engine.is_main_process else None
        holder = [str(root)]
        dist.broadcast_object_list(holder)
        root = Path(holder[0])

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t0

        save_s = timed(lambda: engine.save_state(root / "ckpt"))
        engine2, _model2, _opt2 = build(strategy)
        load_s = timed(lambda: engine2.load_state(root / "ckpt"))
        # the checksum work inside those two, measured alone on the same files
        rank, world = engine.process_index, engine.num_processes
        mine = [*list((root / "ckpt").glob(f"__{rank}_*.distcp")), root / "ckpt" / "rng" / f"rank{rank}.pt"]
        hash_s = timed(lambda: [checksum_file(p) for p in mine])
        meta = checkpoint.read_meta(root / "ckpt")
        verify_s = timed(lambda: checkpoint.verify_files(root / "ckpt", meta, rank, world))
        gb = folder_bytes(root / "ckpt") / 1e9
        model_s = timed(lambda: engine.save_model(model, root / "model"))
        export_s = None
        if engine.is_main_process:
            t0 = time.perf_counter()
            cli.main(["export", str(root / "ckpt"), str(root / "exported")])
            export_s = time.perf_counter() - t0
        dist.barrier()
        if engine.is_main_process:
            results[strategy] = {
                "save_state_s": round(save_s, 2),
                "load_state_s": round(load_s, 2),
                "save_model_s": round(model_s, 2),
                "export_s": round(export_s, 2),
                "checkpoint_mb": round(folder_bytes(root / "ckpt") / 1e6, 1),
                "checksum_at_save_s_per_gb": round(hash_s / gb, 3),
                "checksum_at_load_s_per_gb": round(verify_s / gb, 3),
                "checksum_share_of_save": round(hash_s / save_s, 3),
                "checksum_share_of_load": round(verify_s / load_s, 3),
                "model_mb": round(folder_bytes(root / "model") / 1e6, 1),
            }
            print(f"{strategy:6s} " + "  ".join(f"{k} {v}" for k, v in results[strategy].items()), flush=True)
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    total = sum(p.numel() for p in GPT(vocab=32000, d=768, layers=12, heads=12, block=128).parameters())
    finish_distributed("checkpoint", {
        "model": f"GPT d768 L12 vocab32000 ({total / 1e6:.0f}M parameters, tied embeddings), AdamW",
        "results": results,
    }, args.out)


if __name__ == "__main__":
    main()
