"""`shardwise env`: what a bug report needs (versions, devices, backends, CPU and memory, and the
cluster scheduler detected with the launch settings it gives)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from ..config.tree import ConfigError
from ..version import __version__
from .scheduler import detect


def environment() -> dict[str, str]:
    """What a bug report needs: versions, devices, backends, CPU and memory, the scheduler."""
    import platform
    from importlib import metadata

    import torch
    import torch.distributed as dist

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    cuda = "not available"
    if torch.cuda.is_available():
        cuda = f"{torch.version.cuda} ({torch.cuda.device_count()} device(s))"
    info = {
        "shardwise": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "transformers": version("transformers"),
        "accelerate": version("accelerate"),
        "cuda": cuda,
    }
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        info[f"gpu {i}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    available = (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                 ("mpi", dist.is_mpi_available()))
    info["backends"] = ", ".join(b for b, ok in available if ok) or "none"
    info["cpus"] = str(os.cpu_count())
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory"] = f"{pages * size / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        info["memory"] = "unknown"
    info["scheduler"] = scheduler_line(os.environ)
    info["config"] = os.environ.get("SHARDWISE_CONFIG") or "none (SHARDWISE_CONFIG unset)"
    info["accelerate"] = accelerate_line(os.environ) or info["accelerate"]
    return info


_ACCELERATE_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
                        "ACCELERATE_USE_PARALLELISM_CONFIG")


def accelerate_line(environ: Mapping[str, str]) -> str | None:
    """The settings Accelerate's launcher variables give an `Accelerator` (`accelerate launch
    --config_file X.yaml`), and which variables: None where no such variable is set."""
    on = [v for v in _ACCELERATE_SWITCHES if environ.get(v, "false").lower() in ("1", "true", "yes")]
    if not on:
        return None
    from importlib import metadata

    try:
        from ..accelerate.plugins import read_plugins

        settings, source = read_plugins({})
    except (ImportError, ConfigError, ValueError) as err:
        return f"{metadata.version('accelerate')}; {', '.join(on)} set, unreadable: {err}"
    said = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    return f"{metadata.version('accelerate')}; settings from {source}: {said}"


def scheduler_line(environ: Mapping[str, str]) -> str:
    """The cluster scheduler detected and what `shardwise launch` would derive from it, in a line."""
    try:
        found = detect(environ)
    except ConfigError as err:
        return f"error: {err}"
    if found is None:
        return "none detected (SLURM, Kubernetes PyTorchJob, torchrun's PET_* variables)"
    return found.describe()


def run_env(_ns: argparse.Namespace) -> int:
    """`shardwise env`: the environment as a fenced block to paste into an issue."""
    print("```")
    for key, value in environment().items():
        print(f"{key + ':':14s} {value}")
    print("```")
    return 0
