"""Shared pieces of the benchmark scripts: a GPT-2-shaped model, its loss, reports."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# The model is the demo's (examples/gpt.py), one class for both. Appended, not inserted: the
# benchmarks' own modules (this `common` included) stay first on the path.
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, Block  # re-exported: the benchmarks and tests/test_wrap.py use them

__all__ = ["GPT", "RESULTS", "Block", "finish_distributed", "hardware", "lm_loss", "write_report"]

RESULTS = Path(__file__).resolve().parent / "results"


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    import os

    return f"cpu{os.cpu_count()}"


def write_report(name: str, payload: dict[str, Any], out: Path = RESULTS) -> Path:
    """JSON named by benchmark, hardware and date."""
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    payload = {
        "benchmark": name,
        "date": date,
        "hardware": hardware(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **payload,
    }
    path = out / f"{name}-{hardware()}-{date}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def finish_distributed(name: str, payload: dict[str, Any], out: Path | None) -> None:
    """Rank 0 writes the report (with the torchrun command that reproduces it); all ranks leave."""
    import sys

    import torch.distributed as dist

    if dist.get_rank() == 0:
        command = (f"python -m torch.distributed.run --standalone --nproc-per-node {dist.get_world_size()} "
                   f"benchmarks/{name}.py " + " ".join(sys.argv[1:])).strip()
        path = write_report(name, {"command": command, "world_size": dist.get_world_size(), **payload},
                            out if out is not None else RESULTS)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def run_under_torchrun(script: str, processes: int, args: list[str]) -> list[dict[str, Any]]:
    """Launch `script` under torchrun on `processes` processes with `args` and `--worker-out
    FILE`, and return the rows its rank 0 wrote there (the benchmarks' driver/worker split)."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               script, "--worker-out", str(out), *args]
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())  # type: ignore[no-any-return]

