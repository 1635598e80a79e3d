"""Real client scripts, unchanged but for the import (tests/clients/): diffusers'
train_unconditional.py, with its EMA, under Accelerate itself and under shardwise, 2 CPU processes.

The script is run as its README says, through a launcher, on a tiny image folder and a tiny UNet
config (`--train_data_dir`, `--model_config_name_or_path`), with `--use_ema`, two epochs, its
checkpoint interval past the end. After each epoch's `wait_for_everyone()` it samples and saves its
pipeline on the main process alone (at epoch 0 and at the last), the UNet's EMA weights copied in.
The launcher's environment is Accelerate's CPU one
(`ACCELERATE_USE_CPU`, as `accelerate launch --cpu` sets it: without it Accelerate runs each
torchrun process as a world of one). The script seeds nothing, so `tests/stand_ins/sitecustomize.py`
seeds torch at start-up in both runs alike; torchvision's wheels do not import with this CPU
torch, so the script's `torchvision.transforms` is a stand-in (tests/stand_ins/_torchvision).

- ddp: every logged loss, learning rate and EMA decay equal Accelerate's (1e-6 relative), the
  images it sampled (each epoch's, as logged) equal Accelerate's, and the pipeline the main process
  saves at the end (the UNet with the EMA weights copied in) equals Accelerate's tensor by tensor
  (5e-5 absolute; measured 1.0e-5) and loads with `UNet2DModel.from_pretrained`.
- zero3: the main process's lone sampling and save are forwards and a gather of the sharded UNet
  the other process is not in: it serves them (`shardwise.engine.lone`), its shards holding the EMA
  weights the main process copied into its own. The same numbers, and the log says
  what was served.
"""

from __future__ import annotations

import glob
import os
import sys
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
        "--num_epochs", "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "1", "--use_ema",
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
    acc = _events(out)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("loss", "lr", "ema_decay")}


def _events(out: Path) -> Any:
    """The main process's tensorboard events, read whole (its scalars and every image)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(out / "logs" / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events, size_guidance={"images": 0})
    acc.Reload()
    return acc


def _images(out: Path) -> list[tuple[int, Any]]:
    """The images the script sampled and logged (epoch, pixels), as tensorboard holds them."""
    import io

    import numpy as np
    from PIL import Image

    return [(e.step, np.asarray(Image.open(io.BytesIO(e.encoded_image_string))).astype(int))
            for e in _events(out).Images("test_samples")]


def _unet(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))


UNET_ATOL = 5e-5  # 8 steps: measured 9.5e-6 under ddp, 1.0e-5 under zero3 (a 5x margin)
Reference = tuple[dict[str, Any], dict[str, torch.Tensor], list[tuple[int, Any]]]  # logged, UNet, images


@pytest.fixture(scope="module")
def reference(inputs: Path) -> Reference:
    """The script under Accelerate itself: what it logged and the UNet it saved."""
    code, log, out = _run(SCRIPT, inputs, "accelerate")
    assert code == 0, log[-4000:]
    assert "Distributed environment: DistributedType.MULTI_CPU  Backend: gloo" in log
    return _logged(out), _unet(out), _images(out)


def check_like_accelerate(run: tuple[int, str, Path], reference: Reference) -> None:
    code, log, out = run
    assert code == 0, log[-4000:]
    logged, unet, images = reference
    got = _logged(out)
    assert [s for s, _ in logged["loss"]] == list(range(1, 9))  # 16 images, 2 processes, batch 2, 2 epochs
    for tag in ("loss", "lr", "ema_decay"):
        assert [s for s, _ in got[tag]] == [s for s, _ in logged[tag]], tag
        worst = max(abs(a - b) / max(abs(b), 1e-12) for (_, a), (_, b) in zip(got[tag], logged[tag]))
        assert worst <= 1e-6, f"{tag}: {got[tag]} vs Accelerate's {logged[tag]}"
    sampled = _images(out)  # sampled with the EMA weights, at epochs 0 and 1
    assert [e for e, _ in sampled] == [e for e, _ in images] == [0, 1]
    for (epoch, mine), (_, theirs) in zip(sampled, images):
        off = abs(mine - theirs).max()  # 8-bit pixels: a rounding may tip one level
        assert off <= 1, f"the images sampled at epoch {epoch} differ from Accelerate's by {off} levels"
    saved = _unet(out)
    assert saved.keys() == unet.keys()
    worst = max((saved[k] - unet[k]).abs().max().item() for k in unet)
    assert worst <= UNET_ATOL, f"the saved EMA UNet differs from Accelerate's by {worst:.2e}"


def test_diffusers_train_unconditional_with_ema_gives_accelerates_numbers(
        inputs: Path, reference: Reference, tmp_path: Path) -> None:
    from diffusers import UNet2DModel

    run = _run(_swapped(tmp_path), inputs, "ddp", "strategy: ddp\n")
    check_like_accelerate(run, reference)
    model = UNet2DModel.from_pretrained(str(run[2] / "unet"))  # the saved pipeline's UNet, in a plain process
    saved = _unet(run[2])
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_planted_real_script_scheduler_once_is_caught(
        inputs: Path, reference: Reference, tmp_path: Path) -> None:
    """`real_script_scheduler_once`: a prepared scheduler steps once per call, not once per
    process as Accelerate's does; the script's learning rates leave Accelerate's."""
    run = _run(_swapped(tmp_path), inputs, "ddp_planted", "strategy: ddp\n",
               fault="real_script_scheduler_once")
    caught(check_like_accelerate, run, reference,
           must=r"^loss: \[\(1, [\d.]+\), .*\] vs Accelerate's \[\(1, ")


def check_served(run: tuple[int, str, Path], reference: Reference) -> None:
    """zero3: Accelerate's numbers, the lone calls served (said once per epoch, on the main process)."""
    check_like_accelerate(run, reference)
    said = [ln for ln in run[1].splitlines() if ln.startswith("shardwise: ")
            and "alone after wait_for_everyone(): the other processes ran" in ln]
    assert [ln.rsplit(" until ", 1)[1] for ln in said] == ["a DataLoader pass", "end_training"], said
    served = "main process's 2 no-grad forward(s) and 1 save_pretrained gather(s)"
    assert all(served in ln for ln in said), said


def test_diffusers_train_unconditional_under_zero3_serves_its_lone_sampling_and_save(
        inputs: Path, reference: Reference, tmp_path: Path) -> None:
    check_served(_run(_swapped(tmp_path), inputs, "zero3", "strategy: zero3\n"), reference)


def test_planted_lone_ema_not_replayed_is_caught(inputs: Path, reference: Reference, tmp_path: Path) -> None:
    """`lone_ema_not_replayed`: the other process serves the main process's forwards and gather
    but not its EMA `store` / `copy_to` / `restore`: the UNet it samples and saves is half EMA."""
    run = _run(_swapped(tmp_path), inputs, "zero3_planted", "strategy: zero3\n",
               fault="lone_ema_not_replayed")
    caught(check_served, run, reference,
           must=r"^the images sampled at epoch 0 differ from Accelerate's by \d+ levels")
