"""DeepSpeed with weights in another dtype than their masters (fp16 on a GPU).

DeepSpeed's CPU accelerator has no fp16 (`../shared/notes/deepspeed-on-cpu.md`), so its two
rules are checked here as a GPU run meets them: the config DeepSpeed parses casts float inputs
to fp16 (`fp16.auto_cast`, as Accelerate sets it: without it a model with float inputs fails on
its first matmul), and an export is the fp32 masters, not the cast weights. The export runs for
real on 2 CPU processes under DeepSpeed's own bf16 mode, the one mode on CPU that casts the
module's weights and keeps fp32 masters in the optimizer, as fp16 does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted, planted_here
from spawn import spawn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed")


def check_fp16_casts_float_inputs() -> None:
    """The config shardwise gives DeepSpeed for precision fp16, as DeepSpeed parses it: fp16 on,
    and float inputs cast to fp16 in the engine's forward (`fp16_auto_cast`)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from shardwise.config.tree import EngineConfig
    from shardwise.strategies.deepspeed.setup import deepspeed_config

    for strategy in ("zero1", "zero2", "zero3"):
        cfg = EngineConfig.of(strategy=strategy, backend="deepspeed", precision="fp16")
        parsed = DeepSpeedConfig(deepspeed_config(cfg, device=torch.device("cuda", 0), numel=1000))
        assert parsed.float16_config.enabled, strategy
        assert parsed.float16_config.auto_cast, (
            f"{strategy}: DeepSpeed's fp16 leaves float inputs in fp32 (fp16.auto_cast off): "
            "a float input fails")


def test_deepspeed_fp16_casts_float_inputs() -> None:
    check_fp16_casts_float_inputs()


def test_planted_fp16_inputs_uncast_is_caught() -> None:
    with planted_here("fp16_inputs_uncast"):
        caught(check_fp16_casts_float_inputs, must=r"zero1: DeepSpeed's fp16 leaves float inputs in fp32")


def _export_of_cast_weights(folder: str, strategy: str) -> dict[str, Any]:
    """2 steps of the tiny GPT-2 under DeepSpeed's own bf16 (the module's weights cast, fp32
    masters in its optimizer); the export (`save_model`), the masters (`get_state_dict` reads
    them) and the module's own dtypes."""
    import shardwise
    from shardwise.strategies.deepspeed import setup

    setup._precision_keys = lambda cfg: {"bf16": {"enabled": True}}  # weights cast, masters fp32
    engine = shardwise.Engine(backend="deepspeed", strategy=strategy, cpu=True, seed=W.SEED)
    model, opt = W.one_step(engine, "gpt2")
    ids = W.Tokens(4).data[engine.process_index * 2 : engine.process_index * 2 + 2]
    engine.backward(W.lm_loss(model, ids))
    opt.step()
    module_dtypes = {p.dtype for p in engine.unwrap_model(model).parameters()}
    masters = engine.get_state_dict(model)
    engine.save_model(model, folder)
    engine.end_training()
    if engine.process_index != 0:
        return {}
    from safetensors.torch import load_file

    return {"module_dtypes": module_dtypes, "masters": masters,
            "export": load_file(Path(folder) / "model.safetensors")}


def check_export_is_the_masters(out: dict[str, Any]) -> None:
    assert out["module_dtypes"] == {torch.bfloat16}, \
        f"the module's weights are {out['module_dtypes']}, not cast"
    for name, master in out["masters"].items():
        if not master.is_floating_point():
            continue
        key = name if name in out["export"] else None
        if key is None:  # (a tied weight saved once)
            continue
        saved = out["export"][key]
        assert saved.dtype == torch.float32, f"{name}: {saved.dtype} in the export, the masters float32"
        assert torch.equal(saved, master.float()), f"{name}: the export differs from the fp32 master"


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ds_precision")
    return {s: spawn(_export_of_cast_weights, 2, str(root / s), s)[0] for s in ("zero2", "zero3")}


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_an_export_is_the_fp32_masters_not_the_cast_weights(exports: dict, strategy: str) -> None:
    check_export_is_the_masters(exports[strategy])


def test_planted_export_of_cast_weights_is_caught(tmp_path: Path) -> None:
    worker = planted(_export_of_cast_weights, "export_of_cast_weights")
    out = spawn(worker, 2, str(tmp_path / "export"), "zero3")[0]
    caught(check_export_is_the_masters, out, must=r"bfloat16 in the export, the masters float32")
