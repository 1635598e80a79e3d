"""Calls a script makes on the main process alone, and Accelerate's save/load pre-hooks.

diffusers' train_unconditional.py (tests/accelerate_scripts/train_unconditional.py follows it)
saves its UNet and EMA through `register_save_state_pre_hook` / `register_load_state_pre_hook`
(the hook calls `save_pretrained` on the models it is given) and checkpoints and samples inside
`if accelerator.is_main_process:`. Under ddp that runs as in Accelerate, with its numbers. Under
zero3 with checkpoints and samples made on every process, the hook's main-process-alone saves
of the sharded UNet and of the EMA (passed to `prepare`, so sharded too) write Accelerate's
numbers, and a resume loads them back through the load hook; a main-process-alone sampling
after `wait_for_everyone()` is served by the other process (`shardwise.engine.lone`), with
Accelerate's numbers; a main-process-alone save, or a sampling with no barrier before it, is
refused in one line within seconds, where it used to wait in a collective forever.
The unit tests below prove the same on a small model, against a plain single-process reference.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from spawn import spawn

SCRIPT = "train_unconditional.py"
# hook-saved weights vs Accelerate's, every element, absolute (weights up to ~1; measured at most
# 3.2e-5 under ddp and 2.3e-5 under zero3 after 8 AdamW steps, the losses within 1.6e-7 relative)
WEIGHTS_ATOL = 1e-4


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a diffusers model folder the save hook wrote (`unet/`, `unet_ema/`)."""
    from safetensors.torch import load_file

    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def _check_same_tensors(label: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        atol: float) -> None:
    """The same names, shapes and dtypes, and every tensor within `atol` of `want`'s, element by
    element (atol 0: bit for bit). A gather that puts shards back in the wrong order keeps every
    sum; this does not."""
    assert sorted(got) == sorted(want), f"{label}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    for name, w in want.items():
        g = got[name]
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{label}: {name} is {g.dtype} {tuple(g.shape)}"
        same = torch.equal(g, w) if atol == 0 else bool(((g.double() - w.double()).abs() <= atol).all())
        worst = float((g.double() - w.double()).abs().max()) if g.numel() else 0.0
        assert same, f"{label}: {name} differs from the reference by up to {worst:.3e} (allowed {atol:.0e})"


def _check_saved(label: str, run: dict[str, Any], ckpts: Path, ref: dict[str, Any], ref_ckpts: Path,
                 atol: float) -> None:
    """Every checkpoint's hook-saved `unet/` and `unet_ema/`, tensor by tensor, vs Accelerate's."""
    dirs = [s["dir"] for s in run["saved"]]
    assert dirs == [s["dir"] for s in ref["saved"]] == ["checkpoint-4", "checkpoint-8"], (label, dirs)
    for d in dirs:
        for sub in ("unet", "unet_ema"):
            got, want = _tensors(ckpts / d / sub), _tensors(ref_ckpts / d / sub)
            _check_same_tensors(f"{label} {d}/{sub}", got, want, atol)


def _check_resumed(label: str, resumed: dict[str, Any], loaded: dict[str, Any], ckpt: Path,
                   straight: dict[str, Any], steps: int) -> None:
    """A resume from `ckpt` (checkpoint-4): the load hook brought back the EMA and the weights
    bit for bit (every tensor vs the checkpoint's `unet_ema/` and `unet/`), it trains on from
    step 5, and process 0's first `steps` losses are the straight run's (1e-6 relative): the
    noise it draws comes from the RNG state the checkpoint holds, the one after the save hooks
    ran, as Accelerate saves it (before: the one before them; diffusers' EMA save builds a
    model, which draws: step 5's loss was 0.854 where the straight run's is 0.796)."""
    assert resumed["loaded"]["optimization_step"] == 4, label
    _check_same_tensors(f"{label}: loaded EMA", loaded["ema"], _tensors(ckpt / "unet_ema"), 0)
    _check_same_tensors(f"{label}: loaded weights", loaded["model"], _tensors(ckpt / "unet"), 0)
    assert [s for s, _ in resumed["losses"]] == [5, 6, 7, 8], label
    for (step, a), (_, b) in zip(resumed["losses"][:steps], straight["losses"][4:4 + steps], strict=True):
        assert _close(a, b, 1e-6), f"{label}: step {step}'s loss {a} where the straight run's is {b}"


def test_diffusers_unconditional_script_gives_accelerates_numbers_and_serves_lone_sharded_use(
    tmp_path: Path
) -> None:
    pytest.importorskip("diffusers")  # and accelerate, the reference: both in the test extra
    from test_accelerate_scripts import HERE, _run, _swapped

    ours = _swapped(SCRIPT, tmp_path)
    ref = _run(HERE / SCRIPT, tmp_path, "acc", None, "--output_dir", str(tmp_path / "acc_ckpt"),
               reference=True)
    ddp = _run(ours, tmp_path, "ddp", "strategy: ddp\n", "--output_dir", str(tmp_path / "ddp_ckpt"))
    # ddp: the same loss curve, EMA and UNet (saved by the hook, on the main process alone) and samples
    assert [s for s, _ in ddp["losses"]] == [s for s, _ in ref["losses"]] == list(range(1, 9))
    for (_, a), (_, b) in zip(ddp["losses"], ref["losses"]):
        assert _close(a, b, 1e-5), (a, b)
    _check_saved("ddp", ddp, tmp_path / "ddp_ckpt", ref, tmp_path / "acc_ckpt", WEIGHTS_ATOL)
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
    loaded = torch.load(tmp_path / "ddp_resumed.json.loaded.pt")
    # process 0's lone checkpoint holds process 0's RNG only: its next loss is the straight run's;
    # from step 6 on the mean gradient carries process 1's other noise
    _check_resumed("ddp resumed", resumed, loaded, ckpt, ddp, steps=1)

    # zero3 with the EMA, checkpoints and samples made on every process (--everywhere): the hook
    # saves the sharded UNet it is given and the sharded EMA on the main process alone, with
    # Accelerate's numbers. The EMA in diffusers' own order (built before prepare, never passed to
    # it: adopted at its first step on the sharded parameters); the resume below passes it to
    # prepare, and the load hook brings both back
    ref_all = _run(HERE / SCRIPT, tmp_path, "acc_all", None, "--output_dir", str(tmp_path / "acc_all_ckpt"),
                   "--everywhere", reference=True)
    z3_all = _run(ours, tmp_path, "zero3_all", "strategy: zero3\n", "--output_dir",
                  str(tmp_path / "z3_ckpt"), "--everywhere", "--ema_as_diffusers")
    assert [s for s, _ in z3_all["losses"]] == [s for s, _ in ref_all["losses"]] == list(range(1, 9))
    for (_, a), (_, b) in zip(z3_all["losses"], ref_all["losses"]):
        assert _close(a, b, 1e-4), (a, b)
    _check_saved("zero3", z3_all, tmp_path / "z3_ckpt", ref_all, tmp_path / "acc_all_ckpt", WEIGHTS_ATOL)
    for a, b in zip(z3_all["samples"], ref_all["samples"], strict=True):
        assert _close(a, b, 1e-4), (a, b)
    z3_ckpt = tmp_path / "z3_ckpt" / "checkpoint-4"
    from diffusers import UNet2DModel

    saved_unet = UNet2DModel.from_pretrained(str(z3_ckpt), subfolder="unet")  # a plain process reads it
    _check_same_tensors("zero3 unet/ reloaded", saved_unet.state_dict(),
                        _tensors(tmp_path / "acc_all_ckpt" / "checkpoint-4" / "unet"), WEIGHTS_ATOL)
    z3_resumed = _run(ours, tmp_path, "zero3_resumed", "strategy: zero3\n", "--output_dir",
                      str(tmp_path / "z3_res"), "--everywhere", "--resume_from_checkpoint", str(z3_ckpt),
                      "--no_sample", "--checkpointing_steps", "0")
    loaded = torch.load(tmp_path / "zero3_resumed.json.loaded.pt")
    _check_resumed("zero3 resumed", z3_resumed, loaded, z3_ckpt, z3_all, steps=4)  # every process saved

    # zero3, the EMA in diffusers' order, sampling on the main process alone after
    # wait_for_everyone() (no checkpoints: a lone save_state stays refused, below): the other
    # process serves its forwards and replays its EMA calls (`engine.lone`): Accelerate's numbers
    ref_lone = _run(HERE / SCRIPT, tmp_path, "acc_lone", None, "--checkpointing_steps", "0", reference=True)
    z3 = _run(ours, tmp_path, "zero3", "strategy: zero3\n", "--checkpointing_steps", "0",
              "--ema_as_diffusers")
    assert [s for s, _ in z3["losses"]] == [s for s, _ in ref_lone["losses"]] == list(range(1, 9))
    for (_, a), (_, b) in zip(z3["losses"], ref_lone["losses"]):
        assert _close(a, b, 1e-4), (a, b)
    assert len(z3["samples"]) == len(ref_lone["samples"]) == 2
    for a, b in zip(z3["samples"], ref_lone["samples"]):
        assert _close(a, b, 1e-4), (a, b)


def _hook_saved_unet(folder: str) -> dict[str, torch.Tensor]:
    """The script's UNet prepared under zero3 and saved by its save hook (`save_pretrained` of
    the sharded model it is given, on the main process alone) before any step: the weights it
    had before `prepare`, which the hook's `unet/` must hold bit for bit."""
    from diffusers import UNet2DModel

    from shardwise import Accelerator

    acc = Accelerator(cpu=True, strategy="zero3")
    torch.manual_seed(3)
    model = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
                        block_out_channels=(8, 16), norm_num_groups=4,
                        down_block_types=("DownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "UpBlock2D"))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))

    def save_model_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if acc.is_main_process:
            for m in models:
                m.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()

    acc.register_save_state_pre_hook(save_model_hook)
    acc.save_state(os.path.join(folder, "checkpoint-0"))
    return before


def test_a_gather_in_the_wrong_order_is_caught(tmp_path: Path) -> None:
    """Planted `reorder_gather` (zero3's gather of full weights puts the shards back in reverse
    order: every sum unchanged): the row's tensor check of the hook-saved `unet/` catches it."""
    pytest.importorskip("diffusers")
    from planted import caught, planted

    (tmp_path / "real").mkdir()
    (tmp_path / "planted").mkdir()
    want = spawn(_hook_saved_unet, 2, str(tmp_path / "real"), timeout=300)[0]
    _check_same_tensors("zero3 hook save", _tensors(tmp_path / "real" / "checkpoint-0" / "unet"), want, 0)
    want = spawn(planted(_hook_saved_unet, "reorder_gather"), 2, str(tmp_path / "planted"), timeout=300)[0]
    got = _tensors(tmp_path / "planted" / "checkpoint-0" / "unet")
    assert sum(float(t.double().sum()) for t in got.values()) == pytest.approx(
        sum(float(t.double().sum()) for t in want.values()), rel=1e-9)  # what the sums saw: nothing
    caught(_check_same_tensors, "zero3 hook save", got, want, 0,
           must=r"zero3 hook save: \S+ differs from the reference by up to [\d.]+e[-+]\d+ \(allowed 0e\+00\)")


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
