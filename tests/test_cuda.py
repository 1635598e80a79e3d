"""The CUDA code paths, on a GPU when there is one (CI has none: these skip there).

What only a GPU runs: NCCL beside gloo, the optimizer-offload pipeline (pinned host buffers and
its side CUDA stream), FSDP2's CPUOffloadPolicy moving shards between host and device, the
checkpoint of offloaded optimizer state (host tensors with a CUDA mesh), fp16 loss scaling, and
DeepSpeed on its CUDA accelerator. One process on one GPU against one plain process on the same
GPU, same tolerances as the CPU equivalence tests (losses 1e-5, weights 2e-5).
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any

import pytest
import test_checkpoint as CK
import torch
import workloads as W
from spawn import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

RUN = {"batch": 4, "accum": 2, "steps": 4}
TORCH = [*W.STRATEGIES, {"strategy": "zero1", "offload": "optimizer"}]
DEEPSPEED = [{"backend": "deepspeed", **c} for c in W.STRATEGIES if c["strategy"] != "ddp"]
HAS_DS = importlib.util.find_spec("deepspeed") is not None


def _key(cfg: dict[str, Any]) -> str:
    return "+".join(str(v) for v in cfg.values())


def _all() -> dict[tuple[str, ...], Any]:
    """W.Trained by (model or precision, config); ("resume", src, dst): (straight, first losses, resumed)."""
    out: dict[tuple[str, ...], Any] = {}
    for name in ("tiny", "gpt2"):
        for cfg in TORCH + (DEEPSPEED if HAS_DS else []):
            out[(name, _key(cfg))] = W.train_engine(name, dict(cfg), **RUN)
    for precision in ("bf16", "fp16"):
        for cfg in (
            {"strategy": "zero3"},
            {"strategy": "zero2", "offload": "optimizer"},
            {"backend": "deepspeed", "strategy": "zero2"},
        ):
            if cfg.get("backend") == "deepspeed" and not HAS_DS:
                continue
            out[(precision, _key(cfg))] = W.train_engine("gpt2", {"precision": precision, **cfg}, **RUN)
    with tempfile.TemporaryDirectory() as folder:  # offloaded optimizer state through a checkpoint
        for src, dst in (("zero3+optimizer", "zero2+optimizer"), ("zero1+optimizer", "zero3+params")):
            straight = CK._train(_engine(dst), 8)
            first = CK._train(_engine(src), 4, save=f"{folder}/{src}")
            resumed = CK._train(_engine(dst), 4, load=f"{folder}/{src}")
            out[("resume", src, dst)] = (straight, first.losses, resumed)
    return out


def _engine(spec: str) -> Any:
    import shardwise

    kind, _, offload = spec.partition("+")
    return shardwise.Engine(strategy=kind, offload=offload or "none", seed=W.SEED)  # on the GPU


@pytest.fixture(scope="module")
def runs() -> dict[Any, Any]:
    import os

    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    return spawn(_all, 1)[0]


@pytest.fixture(scope="module")
def refs() -> dict[str, W.Trained]:
    return {name: W.reference(name, world=1, device="cuda", **RUN) for name in ("tiny", "gpt2")}


@pytest.mark.parametrize("cfg", TORCH + DEEPSPEED, ids=_key)
@pytest.mark.parametrize("name", ["tiny", "gpt2"])
def test_cuda_matches_single_process(runs: dict, refs: dict, name: str, cfg: dict[str, str]) -> None:
    if cfg.get("backend") == "deepspeed" and not HAS_DS:
        pytest.skip("deepspeed not installed")
    run, ref = runs[(name, _key(cfg))], refs[name]
    print(f"{name} {_key(cfg)}: losses {W.close(run.losses, ref.losses):.2e} "
          f"weights {W.max_diff(run.state, ref.state):.2e}")
    assert W.close(run.losses, ref.losses) < 1e-5
    assert W.max_diff(run.state, ref.state) < 2e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_low_precision_close_to_fp32(runs: dict, refs: dict, precision: str) -> None:
    ran = [k for k in runs if k[0] == precision]
    assert len(ran) >= 2
    for key in ran:
        losses = runs[key].losses
        print(key, f"{W.close(losses, refs['gpt2'].losses):.2e}")
        assert W.is_finite(losses)
        assert W.close(losses, refs["gpt2"].losses) < 2e-2


def test_cuda_offloaded_optimizer_state_resumes(runs: dict) -> None:
    resumed = [k for k in runs if k[0] == "resume"]
    assert len(resumed) == 2
    for key in resumed:
        straight, first, run = runs[key]
        print(key, f"{W.close(first + run.losses, straight.losses):.2e}")
        assert W.close(first + run.losses, straight.losses) < 1e-5, key
        assert W.max_diff(run.state, straight.state) < 2e-5, key
