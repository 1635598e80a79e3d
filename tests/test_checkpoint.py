"""Checkpoints: exact resume in new processes, resharding across strategies and world sizes,
atomic saves that survive SIGKILL, exports that `transformers` loads, and bad checkpoints.

Exact resume (same world size and strategy) is asserted bit-exact. Across strategies and world
sizes the continued run is compared with one uninterrupted plain process within the tolerance
of the equivalence tests (losses 1e-5, weights 2e-5): the sums of sharded gradients are
rounded differently, exactly as in those tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted, planted_here
from spawn import spawn

N = 24  # samples: 6 global batches of 4 per epoch, so step 4 is mid-epoch and step 8 in epoch 1
G = 4


def _train(engine: Any, steps: int, *, load: str | None = None, save: str | None = None,
           noise: bool = False, name: str = "tiny", save_every: int = 0) -> W.Checkpointed:
    def with_noise(ids: torch.Tensor) -> torch.Tensor:  # uses every RNG the checkpoint restores
        import random

        import numpy as np

        keep = torch.rand(ids.shape) > 0.1 * random.random() * float(np.random.rand())
        return torch.where(keep, ids, 0)

    def at_step(done: int, model: Any, opt: Any) -> None:
        if save_every and done % save_every == 0:
            engine.save_state()

    losses, model, _opt, sched = W.checkpoint_loop(engine, steps, n=N, global_batch=G, name=name, load=load,
                                                   transform=with_noise if noise else None, at_step=at_step)
    if save:
        engine.save_state(save) if save != "auto" else engine.save_state(keep_last=1)
    return W.Checkpointed(losses, engine.get_state_dict(model), engine.step, sched.get_last_lr())


def _reference(steps: int = 8) -> W.Trained:
    """One plain process over the same global batches (the loader's seeded permutation)."""
    return W.plain_reference(steps, N, G)


def _engine(strategy: str) -> Any:
    import shardwise

    kind, _, offload = strategy.partition("+")
    return shardwise.Engine(strategy=kind, offload=offload or "none", cpu=True, seed=W.SEED)


# -- exact resume in new processes ------------------------------------------------------------
def _straight(folder: str) -> W.Checkpointed:
    os.chdir(folder)
    return _train(_engine("zero3"), 8, noise=True)


def _first_half(folder: str) -> W.Checkpointed:
    os.chdir(folder)
    engine = _engine("zero3")
    out = _train(engine, 2, save="auto")  # checkpoints/step_2 ...
    return out


def _second_half(folder: str) -> W.Checkpointed:
    os.chdir(folder)
    return _train(_engine("zero3"), 4, load="latest", noise=True)


def _first_half_then_more(folder: str) -> W.Checkpointed:
    os.chdir(folder)
    engine = _engine("zero3")
    model_out = _train(engine, 4, noise=True, save="auto")
    return model_out


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    a, b = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    straight = spawn(_straight, 2, str(a))[0]
    first = spawn(_first_half_then_more, 2, str(b))[0]
    listing = sorted(p.name for p in (b / "checkpoints").iterdir())
    second = spawn(_second_half, 2, str(b))[0]
    return {"straight": straight, "first": first, "second": second, "listing": listing,
            "root": b / "checkpoints"}


def test_exact_resume_in_new_processes_is_bit_identical(exact: dict) -> None:
    check_exact(exact["straight"], exact["first"], exact["second"])


def check_exact(straight: W.Checkpointed, first: W.Checkpointed, second: W.Checkpointed) -> None:
    assert first.losses + second.losses == straight.losses, \
        f"losses after the resume {second.losses}, the straight run's {straight.losses[len(first.losses):]}"
    assert W.max_diff(second.state, straight.state) == 0.0
    assert second.step == 8 and second.lr == straight.lr


def test_default_folders_latest_and_keep_last(exact: dict) -> None:
    # (the run lock stays: test workers end with os._exit, as a killed run would; see test_run_lock.py)
    assert exact["listing"] == [".shardwise.lock", "latest", "step_4"]
    assert (exact["root"] / "latest").read_text().strip() == "step_4"


# -- the reshard matrix -------------------------------------------------------------------------
SOURCES = ["zero3", "zero2", "zero1", "ddp"]
# every source is a target too
TARGETS = ["zero3", "ddp", "zero2+optimizer", "zero3+params", "zero1+optimizer"]


def _save_sources(folder: str) -> dict[str, W.Checkpointed]:
    return {s: _train(_engine(s), 4, save=f"{folder}/{s}") for s in SOURCES}


def _resume_all(folder: str, targets: list[str]) -> dict[tuple[str, str], W.Checkpointed]:
    return {(s, t): _train(_engine(t), 4, load=f"{folder}/{s}") for s in SOURCES for t in targets if t != s}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("matrix"))
    saved = spawn(_save_sources, 2, folder)[0]
    at2 = spawn(_resume_all, 2, folder, TARGETS)[0]
    at1 = spawn(_resume_all, 1, folder, ["zero3"])[0]
    at4 = spawn(_resume_all, 4, folder, ["zero1"])[0]
    return {"saved": saved, 2: at2, 1: at1, 4: at4, "folder": Path(folder)}


def _save_alone(folder: str) -> W.Checkpointed:
    return _train(_engine("ddp"), 4, save=f"{folder}/alone")


def _resume_alone(folder: str) -> dict[str, W.Checkpointed]:
    return {t: _train(_engine(t), 4, load=f"{folder}/alone") for t in ("zero2+optimizer",)}


def test_resume_one_process_checkpoint_on_two(tmp_path: Path) -> None:
    first = spawn(_save_alone, 1, str(tmp_path))[0]
    ref = _reference(8)
    for target, run in spawn(_resume_alone, 2, str(tmp_path))[0].items():
        assert W.close(first.losses + run.losses, ref.losses) < 1e-5, target
        assert W.max_diff(run.state, ref.state) < 2e-5, target


@pytest.mark.parametrize("world", [2, 1, 4])
def test_resume_at_any_strategy_and_world_size(matrix: dict, world: int) -> None:
    ref = _reference(8)
    runs = matrix[world]
    assert len(runs) == {2: 4 * 5 - 2, 1: 4 - 1, 4: 4 - 1}[world]
    check_resumed(matrix["saved"], runs, ref, world)


def check_resumed(saved: dict[str, W.Checkpointed], runs: dict[tuple[str, str], W.Checkpointed],
                  ref: W.Trained, world: int) -> None:
    for (src, dst), run in runs.items():
        losses = saved[src].losses + run.losses
        assert W.close(losses, ref.losses) < 1e-5, \
            f"{src} -> {dst} at {world} processes: losses {W.close(losses, ref.losses):.2e} " \
            "from one process's"
        assert W.max_diff(run.state, ref.state) < 2e-5, (src, dst, world)
        assert run.step == 8


# -- atomic saves -------------------------------------------------------------------------------
def _killed_while_saving(folder: str) -> None:
    import shardwise.checkpoint.sharded as ck

    os.chdir(folder)
    engine = _engine("zero2")
    real_save = ck.dcp.save

    def save_then_die(*args: Any, **kwargs: Any) -> Any:
        out = real_save(*args, **kwargs)  # the shards are written, meta.json and the rename are not
        if engine.step == 6 and engine.process_index == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    ck.dcp.save = save_then_die
    _train(engine, 6, save_every=3)


def _resume_after_kill(folder: str) -> W.Checkpointed:
    os.chdir(folder)
    return _train(_engine("zero2"), 3, load="latest", save_every=3)  # saves step_6 again


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited with|worker failed"):
        spawn(_killed_while_saving, 2, str(tmp_path), timeout=120)
    root = tmp_path / "checkpoints"
    check_after_kill(root)
    # the run resumes from step_3; its next save to the same place removes what the killed one left
    resumed = spawn(_resume_after_kill, 2, str(tmp_path))[0]
    assert resumed.step == 6
    assert sorted(os.listdir(root)) == [".shardwise.lock", "latest", "step_3", "step_6"]
    assert (root / "latest").read_text().strip() == "step_6"


def test_planted_latest_before_write_is_caught(tmp_path: Path) -> None:
    """`latest_before_write`: `latest` moved when the save begins; after the kill it names the
    checkpoint never completed, which the check after the kill refuses."""
    with pytest.raises(RuntimeError, match=r"exited with|worker failed"):
        spawn(planted(_killed_while_saving, "latest_before_write"), 2, str(tmp_path), timeout=120)
    caught(check_after_kill, tmp_path / "checkpoints",
           must=r"^latest names step_6 after the kill, not step_3")


def check_after_kill(root: Path) -> None:
    """What a process killed while saving step_6 leaves: `latest` still step_3, which verifies and
    reads; the unfinished save only as a hidden staging folder."""
    from shardwise.checkpoint.sharded import full_model_state, read_meta, resolve, verify

    latest = (root / "latest").read_text().strip()
    assert latest == "step_3", f"latest names {latest} after the kill, not step_3"
    assert (root / ".step_6.incomplete").is_dir() and not (root / "step_6").exists()
    # nothing partial in sight; the killed run's lock stays (the resume below takes it over)
    assert sorted(os.listdir(root)) == [".shardwise.lock", ".step_6.incomplete", "latest", "step_3"]
    assert read_meta(resolve(root))["world_size"] == 2
    assert len(verify(root)) >= 5  # every file of step_3 matches its checksum
    state, _ = full_model_state(resolve(root / "latest"))
    assert set(state) >= set(W.build("tiny").state_dict())


# -- export and save_model -----------------------------------------------------------------------
def _export_pair(folder: str) -> torch.Tensor:
    engine = _engine("zero3")
    model, _ = W.one_step(engine, "gpt2")
    engine.save_state(f"{folder}/ckpt")
    engine.save_model(model, f"{folder}/model", max_shard_size="40KB")
    engine.save_model(model, f"{folder}/model-one-file")
    with torch.no_grad():
        logits = model(W.Tokens(2, seed=3).data).logits
    return logits


def test_save_model_and_export_give_what_transformers_loads(tmp_path: Path) -> None:
    check_exports(tmp_path, spawn(_export_pair, 2, str(tmp_path))[0])


def test_an_export_rounded_on_the_way_is_caught(tmp_path: Path) -> None:
    caught(check_exports, tmp_path, spawn(planted(_export_pair, "export_rounded"), 2, str(tmp_path))[0],
           must=r"^model(-one-file)?: logits loaded back [\d.]+e[-+]\d+ from the live model's")


def check_exports(tmp_path: Path, live: torch.Tensor) -> None:
    """save_model's folders load in transformers with the live model's logits, bit for bit, and
    `shardwise export` of the checkpoint writes the same bytes."""
    from transformers import GPT2LMHeadModel

    from shardwise import cli

    assert (tmp_path / "model" / "model.safetensors.index.json").is_file()  # split at 40KB
    for folder in ("model", "model-one-file"):
        back = GPT2LMHeadModel.from_pretrained(tmp_path / folder)
        with torch.no_grad():
            logits = back(W.Tokens(2, seed=3).data).logits
        assert torch.equal(logits, live), \
            f"{folder}: logits loaded back {(logits - live).abs().max().item():.1e} from the live model's"
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "exported"),
                     "--max-shard-size", "40KB"]) == 0
    made = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert made == sorted(p.name for p in (tmp_path / "exported").iterdir())
    for name in made:
        assert (tmp_path / "model" / name).read_bytes() == (tmp_path / "exported" / name).read_bytes(), name
    # exporting again replaces the export's own files, byte for byte the same
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "exported"),
                     "--max-shard-size", "40KB"]) == 0
    assert made == sorted(p.name for p in (tmp_path / "exported").iterdir())
    for name in made:
        assert (tmp_path / "model" / name).read_bytes() == (tmp_path / "exported" / name).read_bytes(), name


# -- bad checkpoints ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "ckpt"
    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = engine.prepare(W.build("tiny"))
    opt = engine.prepare(W.make_optimizer(model))
    del opt
    with torch.no_grad():  # (weights a fresh build does not have: a load that happened would show)
        for p in model.parameters():
            p.add_(1.0)
    engine.save_state(folder)
    return folder


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shardwise-pwned",))


def _not_a_checkpoint(folder: Path, case: str) -> None:
    """The checkpoint's path holding something else: a file, or what save_model writes."""
    from safetensors.torch import save_file

    shutil.rmtree(folder)
    if case == "a file, not a folder":
        folder.write_text("step 100\n")
    else:
        folder.mkdir()
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))


def _tamper(folder: Path, case: str) -> Any:
    """Break a copy of a good checkpoint; return the model to load it into."""
    if case in ("a file, not a folder", "a save_model export"):
        _not_a_checkpoint(folder, case)
        return W.build("tiny")
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    shard = next(folder.glob("*.distcp"))

    def rewrite_meta() -> None:  # a tamperer who also rewrites the recorded sizes and checksums
        from shardwise.checkpoint.storage import checksum_file

        files = [p for p in folder.rglob("*") if p.is_file() and p.name != "meta.json"]
        meta["files"] = {str(p.relative_to(folder)): p.stat().st_size for p in files}
        meta["checksums"] = {str(p.relative_to(folder)): checksum_file(p) for p in files}
        meta_path.write_text(json.dumps(meta))

    if case == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "missing shard":
        shard.unlink()
    elif case == "flipped bytes in the index":
        data = bytearray((folder / ".metadata").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (folder / ".metadata").write_bytes(bytes(data))
    elif case == "pickled code in the index":
        import hashlib
        import pickle

        (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
        meta["dcp_metadata_sha256"] = hashlib.sha256((folder / ".metadata").read_bytes()).hexdigest()
        rewrite_meta()
    elif case == "pickled code in engine state":
        torch.save({"x": Evil()}, folder / "engine.pt")
        rewrite_meta()
    elif case == "loop state of another kind":
        torch.save({"x": 1}, folder / "engine.pt")  # weights-only loadable, checksums rewritten
        rewrite_meta()
    elif case == "loop state of another run":  # a scheduler the model's run never prepared
        state = torch.load(folder / "engine.pt", weights_only=True)
        torch.save({**state, "schedulers": [*state["schedulers"], {"last_epoch": 3}]}, folder / "engine.pt")
        rewrite_meta()
    elif case == "world size metadata":
        meta["world_size"] = 3
        meta_path.write_text(json.dumps(meta))
    elif case == "no meta.json (unfinished save)":
        meta_path.unlink()
    elif case == "corrupted meta.json":
        meta_path.write_text("{not json")
    elif case == "not a shardwise checkpoint":
        meta["format"] = "something-else"
        meta_path.write_text(json.dumps(meta))
    elif case in ("wrong model (shapes)", "wrong model (names)"):
        pass
    return {"wrong model (shapes)": lambda: W.TinyLM(d=16),
            "wrong model (names)": lambda: W.build("gpt2")}.get(case, lambda: W.build("tiny"))()


BAD = {
    "wrong model (shapes)": "model 0 does not match the checkpoint: mis-shaped blocks.0.down.bias "
                            "[32] vs [16]",
    "wrong model (names)": "model 0 does not match the checkpoint: missing lm_head.weight",
    "truncated shard": "truncated or changed",
    "missing shard": "missing from the checkpoint",
    "flipped bytes in the index": "does not match its recorded SHA-256",
    "pickled code in the index": "posix.system is not allowed in a checkpoint index",
    "pickled code in engine state": "unreadable with weights-only loading",
    "a file, not a folder": "ckpt: is a file, not a checkpoint folder (give the folder save_state wrote",
    "a save_model export": "ckpt: holds model weights (a save_model export), not a training checkpoint: "
                           "load them with engine.from_pretrained(cls, path)",
    "loop state of another kind": "engine.pt: the loop state lacks micro_step, step, skipped_steps, scaler "
                                  "(+3 more) (not a shardwise loop state)",
    "loop state of another run": "engine.pt: holds 1 schedulers, 0 prepared now: prepare the same "
                                 "schedulers as the run that saved it before load_state",
    "world size metadata": "says world size 3 but holds the states of 1 process(es)",
    "no meta.json (unfinished save)": "no meta.json: not a shardwise checkpoint, or a save that "
                                      "never finished",
    "corrupted meta.json": "meta.json: corrupted",
    "not a shardwise checkpoint": "not a shardwise checkpoint",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused_with_one_line(case: str, good: Path, tmp_path: Path) -> None:
    check_bad_checkpoint_refused(case, good, tmp_path)


def test_planted_engine_state_unpickled_is_caught(good: Path, tmp_path: Path) -> None:
    """`engine_state_unpickled`: the small files read with full pickle loading; the code stored
    in engine.pt runs and the checkpoint loads, which the refusal check fails."""
    pwned = Path("/tmp/shardwise-pwned")
    try:
        with planted_here("engine_state_unpickled"):
            caught(check_bad_checkpoint_refused, "pickled code in engine state", good, tmp_path,
                   must=r"engine\.pt: the loop state lacks micro_step, step, .*"
                        r"\(not a shardwise loop state\)")
        assert pwned.exists()  # the stored code ran: the fault is what the row guards against
    finally:
        pwned.unlink(missing_ok=True)


def check_bad_checkpoint_refused(case: str, good: Path, tmp_path: Path) -> None:
    import shardwise
    from shardwise.checkpoint.sharded import CheckpointError

    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    model = _tamper(folder, case)
    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = engine.prepare(model)
    engine.prepare(W.make_optimizer(model))
    before = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
    with pytest.raises(CheckpointError) as err:
        engine.load_state(folder)
    msg = str(err.value)
    assert "\n" not in msg and BAD[case] in msg, msg
    assert not Path("/tmp/shardwise-pwned").exists()
    # nothing loaded: the model's weights and the step are the ones it had before
    after = engine.get_state_dict(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert engine.step == 0


def test_a_resume_that_drops_the_rng_state_is_caught(exact: dict, tmp_path: Path) -> None:
    """The second half again, from a copy of the same checkpoint, with the saved RNG state not
    restored (the loop's noise then draws other numbers)."""
    shutil.copytree(exact["root"], tmp_path / "checkpoints", ignore=shutil.ignore_patterns(".shardwise.lock"))
    second = spawn(planted(_second_half, "rng_not_restored"), 2, str(tmp_path))[0]
    caught(check_exact, exact["straight"], exact["first"], second,
           must=r"^losses after the resume \[[\d., ]+\], the straight run's \[")


def test_a_resume_that_drops_the_optimizer_state_is_caught(matrix: dict) -> None:
    """The matrix's resumes into ddp again, with the saved optimizer state not applied."""
    runs = spawn(planted(_resume_all, "optimizer_state_dropped"), 2, str(matrix["folder"]), ["ddp"])[0]
    caught(check_resumed, matrix["saved"], runs, _reference(8), 2,
           must=r"^\w+ -> ddp at 2 processes: losses [\d.]+e[-+]\d+ from one process's")
