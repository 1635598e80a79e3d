"""Host memory and time to get a pretrained model into sharded training, three ways side by side.

    python benchmarks/load.py                          # GPT-2 Large (774M), 2 processes, zero3
    python benchmarks/load.py --model gpt2 --rounds 1  # quicker

Each way runs in its own fresh processes (`torchrun --nproc-per-node 2`), in alternating rounds:
  whole      every process builds the model and loads the whole checkpoint
             (`GPT2LMHeadModel.from_pretrained`), then `prepare` shards it: what users get today;
  broadcast  Accelerate's `cpu_ram_efficient_loading` done by hand with the same steps: process 0
             loads the whole checkpoint, the others build on the meta device, the model is
             sharded (FSDP2) and allocated empty, and every parameter is broadcast from process 0
             whole and cut to each shard (`fsdp2_load_full_state_dict`);
  shardwise  `engine.from_pretrained(GPT2LMHeadModel, path)` + `prepare`: built empty, each
             process reads its own rows of each tensor;
  init       `with engine.init_empty(): model = GPT2LMHeadModel(config)`, `prepare` (the
             constructor's initialization replayed into the shards), then `engine.load_model`.
Per process: the high-water mark of resident memory (`VmHWM` in /proc/self/status) minus its
value just before the model is built (and, for the two shardwise ways, just after it is built
empty), and the seconds until the sharded model is ready. The
checkpoint is a `save_pretrained` of the model with seeded random weights, made once and cached.
Also prints the planner's prediction (`shardwise plan`'s "host memory to build and load").
Writes benchmarks/results/load-<hardware>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SIZES = {"gpt2-large": {"n_embd": 1280, "n_layer": 36, "n_head": 20},
         "gpt2": {"n_embd": 768, "n_layer": 12, "n_head": 12}}
WAYS = ["whole", "broadcast", "shardwise", "init"]


def _config(name: str) -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_positions=1024, **SIZES[name])


def make_checkpoint(name: str, cache: Path) -> Path:
    path = cache / f"{name}-pretrained"
    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return path
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(_config(name)).save_pretrained(path, max_shard_size="1GB")
    return path


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(way: str, path: str, report: Path) -> None:
    """One way, in this process (started by torchrun); each process writes one JSON file."""
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    import shardwise

    engine = shardwise.Engine(preempt_signals=(), strategy="zero3", cpu=True)
    dist.barrier()
    before = _hwm()
    t0 = time.perf_counter()
    built = None
    if way == "whole":
        model = engine.prepare(GPT2LMHeadModel.from_pretrained(path))
    elif way == "shardwise":
        empty = engine.from_pretrained(GPT2LMHeadModel, path)
        built = _hwm() - before
        model = engine.prepare(empty)
    elif way == "init":
        with engine.init_empty():
            empty = GPT2LMHeadModel(_config_from(path))
        built = _hwm() - before
        model = engine.prepare(empty)
        engine.load_model(model, path)
    else:
        model = _broadcast_load(engine, path)
    dist.barrier()
    seconds = time.perf_counter() - t0
    params = sum(p.numel() * p.element_size() for p in engine.unwrap_model(model).parameters())
    row = {"way": way, "rank": engine.process_index, "peak_bytes": _hwm() - before, "seconds": seconds,
           "full_param_bytes": params, "built_bytes": built}
    (report / f"rank{engine.process_index}.json").write_text(json.dumps(row))
    engine.end_training()


def _broadcast_load(engine: Any, path: str) -> Any:
    """Accelerate's cpu_ram_efficient_loading on FSDP2 (accelerate/utils/fsdp_utils.py:
    fsdp2_load_full_state_dict), with the same steps and torch calls."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from transformers import GPT2LMHeadModel

    if engine.process_index == 0:
        model = GPT2LMHeadModel.from_pretrained(path)
        full_sd = model.state_dict()
        model = model.to("meta")
    else:
        with torch.device("meta"):
            model = GPT2LMHeadModel(_config_from(path))
        full_sd = {}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from shardwise.strategies import apply_fsdp, find_blocks

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    apply_fsdp(model, mesh=mesh, blocks=find_blocks(model, ()), reshard_after_forward=True,
               mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy())
    model.to_empty(device="cpu")
    meta_sd = model.state_dict()
    sharded = {}
    for name, sharded_param in meta_sd.items():
        if engine.process_index == 0:
            full = full_sd[name]
        else:
            full = torch.empty(sharded_param.shape, dtype=sharded_param.dtype)
        dist.broadcast(full, src=0)
        sharded[name] = torch.nn.Parameter(distribute_tensor(full, mesh, sharded_param.placements))
        del full
    model.load_state_dict(sharded, assign=True)
    return model


def _config_from(path: str) -> Any:
    from transformers import GPT2Config

    return GPT2Config.from_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SIZES), default="gpt2-large")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three ways")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "shardwise-bench")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.path, args.report)
        return
    path = make_checkpoint(args.model, args.cache)
    rows: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    for r in range(args.rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            with tempfile.TemporaryDirectory() as report:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       __file__, "--worker", way, "--path", str(path), "--report", report]
                proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1800)
                lines = [json.loads(f.read_text()) for f in sorted(Path(report).glob("rank*.json"))]
            if proc.returncode != 0 or len(lines) != 2:
                raise SystemExit(f"{way} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            rows[way] += lines
    full = rows["whole"][0]["full_param_bytes"]
    summary = {}
    for way in WAYS:
        peak = max(x["peak_bytes"] for x in rows[way])
        per_rank = [max(x["peak_bytes"] for x in rows[way] if x["rank"] == k) for k in (0, 1)]
        seconds = sorted(x["seconds"] for x in rows[way])[len(rows[way]) // 2]
        summary[way] = {"peak_gib_per_rank": [round(p / 2**30, 2) for p in per_rank],
                        "peak_over_full_model": round(peak / full, 3), "median_seconds": round(seconds, 1)}
        if rows[way][0]["built_bytes"] is not None:
            summary[way]["built_over_full_model"] = round(max(x["built_bytes"] for x in rows[way]) / full, 3)
    summary["ratios"] = {
        "shardwise_peak_over_whole": round(max(summary["shardwise"]["peak_gib_per_rank"])
                                           / max(summary["whole"]["peak_gib_per_rank"]), 2),
        "shardwise_time_over_broadcast": round(summary["shardwise"]["median_seconds"]
                                               / summary["broadcast"]["median_seconds"], 2),
    }
    summary["planner"] = _predicted(args.model)
    for way in WAYS:
        s = summary[way]
        built = f"; built empty: {s['built_over_full_model']}x" if "built_over_full_model" in s else ""
        print(f"{way:10s} peak per rank {s['peak_gib_per_rank']} GiB "
              f"({s['peak_over_full_model']}x the fp32 model{built}), {s['median_seconds']} s")
    print(json.dumps(summary["ratios"]), json.dumps(summary["planner"]))
    from common import write_report

    payload = {"command": "python benchmarks/load.py " + " ".join(sys.argv[1:]), "world_size": 2,
               "model": f"{args.model} ({full / 4 / 1e6:.0f}M parameters, fp32)", "results": summary,
               "raw": rows}
    written = write_report("load", payload, args.out) if args.out else write_report("load", payload)
    print(f"wrote {written}")


def _predicted(name: str) -> dict[str, float]:
    from shardwise.plan import Candidate
    from shardwise.plan.load import load_memory
    from shardwise.plan.presets import resolve_model

    spec = resolve_model(name, seq_len=128)
    zero3 = Candidate("zero3")  # what the shardwise way runs
    mem = load_memory(spec, [zero3], world_size=2, device="cpu")
    return {"whole_gib": round(mem.whole / 2**30, 2),
            "shardwise_zero3_gib": round(mem.load[zero3] / 2**30, 2),
            "init_zero3_gib": round(mem.init[zero3] / 2**30, 2)}


if __name__ == "__main__":
    main()
