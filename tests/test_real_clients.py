"""Real client scripts, unchanged but for the import (tests/clients/): diffusers'
train_unconditional.py, with its EMA, under Accelerate itself and under shardwise, 2 CPU processes.

The script is run as its README says, through a launcher, on a tiny image folder and a tiny UNet
config (`--train_data_dir`, `--model_config_name_or_path`), with `--use_ema`, one epoch, its
checkpoint interval past the end. The launcher's environment is Accelerate's CPU one
(`ACCELERATE_USE_CPU`, as `accelerate launch --cpu` sets it: without it Accelerate runs each
torchrun process as a world of one). The script seeds nothing, so `tests/stand_ins/sitecustomize.py`
seeds torch at start-up in both runs alike; torchvision's wheels do not import with this CPU
torch, so the script's `torchvision.transforms` is a stand-in (tests/stand_ins/_torchvision).

- ddp: every logged loss, learning rate and EMA decay equal Accelerate's (1e-6 relative), and the
  pipeline the main process saves at the end (the UNet with the EMA weights copied in) equals
  Accelerate's tensor by tensor (1e-5 absolute) and loads with `UNet2DModel.from_pretrained`.
- zero3: the script samples on the main process alone at its last epoch, a forward of the sharded
  UNet the other process is not in: refused in one line on the main process, within seconds,
  never a hang (issue 44: serving such lone calls is not built).
"""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from planted import caught, fault_env
from spawn import run_command
from test_accelerate_scripts import _swapped as swapped

pytest.importorskip("datasets")  # the script's data loading; installed by `make test` (the test extra)
pytest.importorskip("diffusers")

HERE = Path(__file__).parent
SCRIPT = HERE / "clients" / "diffusers" / "train_unconditional.py"
STAND_INS = HERE / "stand_ins"
IMPORT = "from accelerate import Accelerator, InitProcessGroupKwargs\n"
ARGS = ["--resolution", "8", "--center_crop", "--train_batch_size", "2", "--eval_batch_size", "2",
        "--num_epochs", "1", "--learning_rate", "1e-3", "--lr_warmup_steps", "1", "--use_ema",
        "--ddpm_num_steps", "50", "--ddpm_num_inference_steps", "2", "--checkpointing_steps", "1000",
        "--dataloader_num_workers", "0", "--logging_dir", "logs"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 images of 12x12 (4 steps a process at batch 2 over 2 processes), a tiny UNet config."""
    import numpy as np
    from diffusers import UNet2DModel
    from PIL import Image

    root = tmp_path_factory.mktemp("real_clients")
    (root / "data" / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(16):
        pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "data" / "train" / f"{i}.png")
    UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                norm_num_groups=4).save_config(root / "unet_config")
    return root


def _swapped(tmp: Path) -> Path:
    """The script with its one import line changed, and nothing else."""
    return swapped(SCRIPT.name, tmp, SCRIPT.parent, IMPORT,
                   "from accelerate import InitProcessGroupKwargs\nfrom shardwise import Accelerator\n")


def _run(script: Path, root: Path, label: str, config: str | None = None,
         fault: str | None = None) -> tuple[int, str, Path]:
    """The script on 2 processes under torchrun: exit code, output, its output folder. A run
    still going after 300 s is killed and fails (`run_command`'s timeout)."""
    out = root / label
    paths = [str(STAND_INS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "STAND_IN_SEED": "0",
           "STAND_IN_TORCHVISION": "1", "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("SHARDWISE_CONFIG", None)
    if config is not None:
        (root / f"{label}.yaml").write_text(config)
        env["SHARDWISE_CONFIG"] = str(root / f"{label}.yaml")
    env = fault_env(fault, env) if fault else env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--train_data_dir", str(root / "data"),
           "--model_config_name_or_path", str(root / "unet_config"), "--output_dir", str(out),
           "--cache_dir", str(root / "cache"), *ARGS]
    proc = run_command(cmd, cwd=root, env=env, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr, out


def _logged(out: Path) -> dict[str, list[tuple[int, float]]]:
    """What the script logged to tensorboard (the main process's tracker): tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(out / "logs" / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("loss", "lr", "ema_decay")}


def _unet(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def reference(inputs: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The script under Accelerate itself: what it logged and the UNet it saved."""
    code, log, out = _run(SCRIPT, inputs, "accelerate")
    assert code == 0, log[-4000:]
    assert "Distributed environment: DistributedType.MULTI_CPU  Backend: gloo" in log
    return _logged(out), _unet(out)


Reference = tuple[dict[str, Any], dict[str, torch.Tensor]]


def check_like_accelerate(run: tuple[int, str, Path], reference: Reference) -> None:
    code, log, out = run
    assert code == 0, log[-4000:]
    logged, unet = reference
    got = _logged(out)
    assert [s for s, _ in logged["loss"]] == [1, 2, 3, 4]  # 16 images, 2 processes, batch 2
    for tag in ("loss", "lr", "ema_decay"):
        assert [s for s, _ in got[tag]] == [s for s, _ in logged[tag]], tag
        worst = max(abs(a - b) / max(abs(b), 1e-12) for (_, a), (_, b) in zip(got[tag], logged[tag]))
        assert worst <= 1e-6, f"{tag}: {got[tag]} vs Accelerate's {logged[tag]}"
    saved = _unet(out)
    assert saved.keys() == unet.keys()
    worst = max((saved[k] - unet[k]).abs().max().item() for k in unet)
    assert worst <= 1e-5, f"the saved EMA UNet differs from Accelerate's by {worst:.2e}"


def test_diffusers_train_unconditional_with_ema_gives_accelerates_numbers(
        inputs: Path, reference: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path: Path) -> None:
    from diffusers import UNet2DModel

    run = _run(_swapped(tmp_path), inputs, "ddp", "strategy: ddp\n")
    check_like_accelerate(run, reference)
    model = UNet2DModel.from_pretrained(str(run[2] / "unet"))  # the saved pipeline's UNet, in a plain process
    saved = _unet(run[2])
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_planted_real_script_scheduler_once_is_caught(
        inputs: Path, reference: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path: Path) -> None:
    """`real_script_scheduler_once`: a prepared scheduler steps once per call, not once per
    process as Accelerate's does; the script's learning rates leave Accelerate's."""
    run = _run(_swapped(tmp_path), inputs, "ddp_planted", "strategy: ddp\n",
               fault="real_script_scheduler_once")
    caught(check_like_accelerate, run, reference)


def test_diffusers_train_unconditional_under_zero3_refuses_its_lone_sampling(inputs: Path,
                                                                             tmp_path: Path) -> None:
    start = time.monotonic()
    code, log, _ = _run(_swapped(tmp_path), inputs, "zero3", "strategy: zero3\n")
    assert code != 0 and time.monotonic() - start < 120, log[-4000:]
    said = [ln for ln in log.splitlines() if "RuntimeError: a forward of the sharded UNet2DModel ran on one "
            "process alone" in ln]
    assert said and all(ln.startswith("[rank0]:") for ln in said), log[-4000:]  # the main process, one line
    assert said[0].endswith("then load it into an unsharded model"), said[0]
