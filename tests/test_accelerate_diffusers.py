"""Calls a script makes on the main process alone, and Accelerate's save/load pre-hooks.

diffusers' train_unconditional.py (tests/accelerate_scripts/train_unconditional.py follows it)
saves its UNet and EMA through `register_save_state_pre_hook` / `register_load_state_pre_hook`
(the hook calls `save_pretrained` on the models it is given) and checkpoints and samples inside
`if accelerator.is_main_process:`. Under ddp that runs as in Accelerate, with its numbers. Under
zero3 with checkpoints and samples made on every process, the hook's main-process-alone saves
of the sharded UNet and of the EMA (passed to `prepare`, so sharded too) write Accelerate's
numbers, and a resume loads them back through the load hook; a main-process-alone save or
sampling is refused in one line within seconds, where it used to wait in a collective forever.
The unit tests below prove the same on a small model, against a plain single-process reference.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from spawn import spawn

SCRIPT = "train_unconditional.py"


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _refused(script: Path, tmp: Path, label: str, config: str,
             *extra: str) -> tuple[str, float, dict[str, Any]]:
    """A run expected to stop with an error: its stderr, its seconds, and what it recorded."""
    import json

    out = tmp / f"{label}.json"
    cfg = tmp / f"{label}.yaml"
    cfg.write_text(config)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "SHARDWISE_CONFIG": str(cfg)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--cpu", "--out", str(out), "--project_dir", str(tmp / label), *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"{label}: still running after 240 s (a hang)\n{err[-3000:]}")
    assert proc.returncode != 0, f"{label}: expected a refusal"
    return err, time.monotonic() - start, json.loads(out.read_text())


def test_diffusers_unconditional_script_gives_accelerates_numbers_and_refuses_lone_sharded_use(
    tmp_path: Path
) -> None:
    pytest.importorskip("diffusers")  # and accelerate, the reference: both in the test extra
    from test_accelerate_scripts import HERE, _run, _swapped

    ours = _swapped(SCRIPT, tmp_path)
    ref = _run(HERE / SCRIPT, tmp_path, "acc", None, "--output_dir", str(tmp_path / "acc_ckpt"))
    ddp = _run(ours, tmp_path, "ddp", "strategy: ddp\n", "--output_dir", str(tmp_path / "ddp_ckpt"))
    # ddp: the same loss curve, EMA (saved by the hook, on the main process alone) and samples
    assert [s for s, _ in ddp["losses"]] == [s for s, _ in ref["losses"]] == list(range(1, 9))
    for (_, a), (_, b) in zip(ddp["losses"], ref["losses"]):
        assert _close(a, b, 1e-5), (a, b)
    assert ([s["dir"] for s in ddp["saved"]] == [s["dir"] for s in ref["saved"]]
            == ["checkpoint-4", "checkpoint-8"])
    for a, b in zip(ddp["saved"], ref["saved"]):
        assert _close(a["ema"], b["ema"], 1e-5)
    assert len(ddp["samples"]) == len(ref["samples"]) == 2
    for a, b in zip(ddp["samples"], ref["samples"]):
        assert _close(a, b, 1e-4)
    ckpt = tmp_path / "ddp_ckpt" / "checkpoint-4"
    assert (ckpt / "unet_ema" / "config.json").is_file() and (ckpt / "unet" / "config.json").is_file()
    assert (ckpt / "meta.json").is_file()  # and shardwise's own checkpoint, written by process 0 alone

    # resumed on both processes from the main process's checkpoint: the load hook brings the EMA
    # back, and the weights are the ones saved
    resumed = _run(ours, tmp_path, "ddp_resumed", "strategy: ddp\n", "--output_dir", str(tmp_path / "res"),
                   "--resume_from_checkpoint", str(ckpt), "--no_sample", "--checkpointing_steps", "0")
    assert resumed["loaded"]["ema"] == pytest.approx(ddp["saved"][0]["ema"], rel=1e-12)
    assert resumed["loaded"]["optimization_step"] == 4
    assert resumed["loaded"]["model"] == pytest.approx(ddp["saved"][0]["model"], rel=1e-12)
    assert [s for s, _ in resumed["losses"]] == [5, 6, 7, 8]

    # zero3 with the EMA, checkpoints and samples made on every process (--everywhere): the hook
    # saves the sharded UNet it is given and the (prepared, sharded) EMA on the main process
    # alone, with Accelerate's numbers; a resume through the load hook brings both back
    ref_all = _run(HERE / SCRIPT, tmp_path, "acc_all", None, "--output_dir", str(tmp_path / "acc_all_ckpt"),
                   "--everywhere")
    z3_all = _run(ours, tmp_path, "zero3_all", "strategy: zero3\n", "--output_dir",
                  str(tmp_path / "z3_ckpt"), "--everywhere")
    assert [s for s, _ in z3_all["losses"]] == [s for s, _ in ref_all["losses"]] == list(range(1, 9))
    for (_, a), (_, b) in zip(z3_all["losses"], ref_all["losses"]):
        assert _close(a, b, 1e-4), (a, b)
    assert [s["dir"] for s in z3_all["saved"]] == ["checkpoint-4", "checkpoint-8"]
    for a, b in zip(z3_all["saved"], ref_all["saved"], strict=True):
        assert _close(a["ema"], b["ema"], 1e-5) and _close(a["model"], b["model"], 1e-5), (a, b)
    for a, b in zip(z3_all["samples"], ref_all["samples"], strict=True):
        assert _close(a, b, 1e-4), (a, b)
    z3_ckpt = tmp_path / "z3_ckpt" / "checkpoint-4"
    from diffusers import UNet2DModel

    saved_unet = UNet2DModel.from_pretrained(str(z3_ckpt), subfolder="unet")  # a plain process reads it
    on_disk = sum(float(p.detach().double().sum()) for p in saved_unet.parameters())
    assert _close(on_disk, z3_all["saved"][0]["model"], 1e-9)
    z3_resumed = _run(ours, tmp_path, "zero3_resumed", "strategy: zero3\n", "--output_dir",
                      str(tmp_path / "z3_res"), "--everywhere", "--resume_from_checkpoint", str(z3_ckpt),
                      "--no_sample", "--checkpointing_steps", "0")
    assert z3_resumed["loaded"]["ema"] == pytest.approx(z3_all["saved"][0]["ema"], rel=1e-12)
    assert z3_resumed["loaded"]["model"] == pytest.approx(z3_all["saved"][0]["model"], rel=1e-12)
    assert [s for s, _ in z3_resumed["losses"]] == [5, 6, 7, 8]

    # zero3: epoch 0 is Accelerate's, then the main process's sampling with the sharded UNet is
    # refused in one line, within seconds (it used to wait in the all-gather forever)
    err, seconds, z3 = _refused(ours, tmp_path, "zero3", "strategy: zero3\n", "--no_ema",
                                "--checkpointing_steps", "0")
    assert [s for s, _ in z3["losses"]] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(z3["losses"], ref["losses"]):
        assert _close(a, b, 1e-4), (a, b)
    assert "RuntimeError: a forward of the sharded UNet2DModel ran on one process alone" in err, err[-3000:]
    assert seconds < 120


# -- the same on a small model, in-process ------------------------------------------------------
def _lone_calls(folder: str, strategy: str) -> dict[str, Any]:
    from shardwise import Accelerator

    os.chdir(folder)
    acc = Accelerator(cpu=True, strategy=strategy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    calls: list[tuple[str, Any]] = []
    save_handle = acc.register_save_state_pre_hook(
        lambda models, weights, out: calls.append(
            ("save", (len(models), sorted(weights[0]), Path(out).name))))
    acc.register_load_state_pre_hook(
        lambda models, out: calls.append(("load", (len(models), Path(out).name))))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 6, generator=g) for _ in range(2 * acc.num_processes)]
    for i in range(2):
        loss = model(data[2 * i + acc.process_index]).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    out: dict[str, Any] = {}
    start = time.monotonic()
    acc.save_state("together")  # every process: pays one store round trip for the arrival check
    out["together_s"] = time.monotonic() - start
    if acc.is_main_process:
        start = time.monotonic()
        try:
            acc.save_state("alone")
            out["alone"] = "saved"
        except RuntimeError as err:
            out["alone"] = str(err)
        out["alone_s"] = time.monotonic() - start
        with torch.no_grad():
            try:
                model(data[0])
                out["forward"] = "ran"
            except RuntimeError as err:
                out["forward"] = str(err)
    acc.wait_for_everyone()
    out["weights"] = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    save_handle.remove()
    if strategy == "ddp":
        with torch.no_grad():
            model(data[0])  # every process: a no-grad forward needs no check here
        for p in model.parameters():  # load_state on every process must bring the lone save back
            p.data.add_(1.0)
        acc.load_state("alone")
        out["reloaded"] = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
        acc.save_state("after_remove")  # the removed save hook is not called
        if acc.is_main_process:
            time.sleep(4)  # busy alone (logging, sampling) past the arrival wait, before a save by all
        acc.save_state("late_main")  # the other process waits for it: one checkpoint of both
    out["calls"] = calls
    return out


def _reference() -> dict[str, torch.Tensor]:
    """The same two steps in one process: the gradient of the mean over both processes' data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 6, generator=g) for _ in range(4)]
    for i in range(2):
        loss = (model(data[2 * i]).pow(2).mean() + model(data[2 * i + 1]).pow(2).mean()) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_lone_save_state_and_forward(tmp_path: Path) -> None:
    ref = _reference()
    ddp_dir, z3_dir = tmp_path / "ddp", tmp_path / "zero3"
    ddp_dir.mkdir()
    z3_dir.mkdir()
    ddp = spawn(_lone_calls, 2, str(ddp_dir), "ddp", timeout=300)
    z3 = spawn(_lone_calls, 2, str(z3_dir), "zero3", timeout=300)
    for name, t in ref.items():
        torch.testing.assert_close(ddp[0]["weights"][name], t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(z3[0]["weights"][name], t, rtol=1e-5, atol=1e-6)
        for rank in (0, 1):  # ddp: process 0's lone save is a checkpoint every process loads
            torch.testing.assert_close(ddp[rank]["reloaded"][name], ddp[0]["weights"][name], rtol=0, atol=0)
    assert ddp[0]["alone"] == "saved" and ddp[0]["forward"] == "ran"
    assert (ddp_dir / "alone" / "meta.json").is_file()
    assert sorted(p.name for p in (ddp_dir / "alone" / "rng").iterdir()) == ["rank0.pt"]
    assert sorted(p.name for p in (ddp_dir / "late_main" / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    # zero3: refused in one line after the arrival wait, not hung
    assert (z3[0]["alone"].startswith("save_state() was called on process 0 alone")
            and "\n" not in z3[0]["alone"])
    assert z3[0]["alone_s"] < 10  # the other process went on to wait_for_everyone: found at once
    assert z3[0]["forward"].startswith("a forward of the sharded Sequential ran on one process alone")
    assert not (z3_dir / "alone").exists()
    # hooks with Accelerate's signatures: save (models, weights, output_dir), load (models, input_dir),
    # on every process that makes the call; removed: not called again
    weights = sorted(ref)
    assert ddp[0]["calls"] == [("save", (1, weights, "together")), ("save", (1, weights, "alone")),
                               ("load", (1, "alone"))]
    assert ddp[1]["calls"] == [("save", (1, weights, "together")), ("load", (1, "alone"))]
    assert z3[0]["calls"][0] == ("save", (1, weights, "together"))
    assert max(r["together_s"] for r in (*ddp, *z3)) < 2.0  # an all-process save waits for no timeout
