"""Nothing a user saved is lost, and nothing loads that is not what was written.

What a careless user does, on 2 processes (the torch engine here; the DeepSpeed engine runs the
same `careless_user` in test_deepspeed.py): saving weights into a folder that already holds a
tokenizer and results, saving a checkpoint onto a folder of their files, onto a file, onto the
current directory, re-saving, flipping bytes in a shard, resuming AdamW state into SGD, running
out of disk space mid-save, and SIGKILL in the middle of `save_model`.

Every refusal must happen on every process (none left waiting), leave the file tree exactly as
it was (compared file by file, hidden files included), and be one line naming the path.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted, planted_here
from spawn import spawn

USER_FILES = {"tokenizer.json": '{"vocab": "mine"}', "results.txt": "accuracy 0.91\n"}


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (hidden ones too) with its bytes' checksum."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _error(fn: Any) -> str | None:
    from shardwise.checkpoint.sharded import CheckpointError

    try:
        fn()
    except CheckpointError as err:
        return str(err)
    return None


def _flip(path: Path, n: int = 16) -> None:
    """Flip `n` bytes in the middle of a file: same size, different content."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def _hugging_face_pattern(engine: Any, model: Any) -> dict[str, Any]:
    """The tokenizer and results written first into `outputs/`, then save_model three times (one
    file, split, one file again): the listings, the user's files as read back, the weights."""
    out: dict[str, Any] = {}
    if engine.is_main_process:
        Path("outputs").mkdir()
        for name, text in USER_FILES.items():
            (Path("outputs") / name).write_text(text)
    engine.wait_for_everyone()
    engine.save_model(model, "outputs")
    out["after_save_model"] = sorted(os.listdir("outputs"))
    engine.save_model(model, "outputs", max_shard_size="40KB")  # another split: our single file goes
    out["after_split"] = sorted(os.listdir("outputs"))
    engine.save_model(model, "outputs")  # one file again: our shards and index go
    out["after_one_file_again"] = sorted(os.listdir("outputs"))
    out["user_files"] = {n: (Path("outputs") / n).read_text() if (Path("outputs") / n).exists() else None
                         for n in USER_FILES}
    out["weights"] = engine.get_state_dict(model)
    return out


def _hugging_face_pattern_only(folder: str) -> dict[str, Any]:
    import shardwise

    (Path(folder) / "run").mkdir(parents=True, exist_ok=True)
    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    os.chdir(Path(folder) / "run")
    model, _ = W.one_step(engine, "gpt2")
    return _hugging_face_pattern(engine, model)


def careless_user(backend: str, folder: str) -> dict[str, Any]:
    """Every case of the data-safety issue, on an engine of `backend`; observations to assert."""
    import shardwise

    base = Path(folder)
    run = base / "run"
    if int(os.environ["RANK"]) == 0:
        run.mkdir(parents=True)
        (base / "empty").mkdir()
    out: dict[str, Any] = {"refused": {}}

    def engine_for() -> Any:
        return shardwise.Engine(backend=backend, strategy="zero3", cpu=True, seed=W.SEED)

    engine = engine_for()
    engine.wait_for_everyone()
    os.chdir(run)
    main = engine.is_main_process
    model, _opt = W.one_step(engine, "gpt2")

    # 1. the Hugging Face pattern: the tokenizer and results first, the weights after
    out.update(_hugging_face_pattern(engine, model))

    # 2. a model.safetensors shardwise did not write would shadow new shards: refused
    if main:
        from safetensors.torch import save_file

        Path("foreign").mkdir()
        save_file({"w": torch.ones(3)}, "foreign/model.safetensors")
    engine.wait_for_everyone()
    before = snapshot(base)
    out["refused"]["shadow"] = _error(lambda: engine.save_model(model, "foreign", max_shard_size="40KB"))
    out["refused"]["save_model onto a file"] = _error(lambda: engine.save_model(model, "outputs/results.txt"))

    # 3. save_state onto what is not a checkpoint: refused before anything is written
    out["refused"]["foreign folder"] = _error(lambda: engine.save_state("outputs"))
    out["refused"]["file"] = _error(lambda: engine.save_state("outputs/results.txt"))
    out["refused"]["cwd"] = _error(lambda: engine.save_state(os.getcwd()))
    out["refused"]["parent of cwd"] = _error(lambda: engine.save_state(".."))
    os.chdir(base / "empty")
    out["refused"]["empty cwd"] = _error(lambda: engine.save_state(os.getcwd()))
    os.chdir(run)
    out["untouched_after_refusals"] = snapshot(base) == before

    # 4. a checkpoint replaces an earlier checkpoint (and an empty folder), nothing hidden left
    engine.save_state("ckpt")
    engine.save_state("ckpt")
    if main:
        Path("empty_target").mkdir()
    engine.wait_for_everyone()
    engine.save_state("empty_target")
    out["listing_after_resaves"] = sorted(os.listdir("."))
    # ... but not one a user added a file to
    if main:
        Path("ckpt_with_notes").mkdir()
    engine.wait_for_everyone()
    engine.save_state("ckpt_with_notes")
    if main:
        Path("ckpt_with_notes/notes.txt").write_text("lr sweep 3")
    engine.wait_for_everyone()
    before = snapshot(base)
    out["refused"]["checkpoint with a user's file"] = _error(lambda: engine.save_state("ckpt_with_notes"))
    out["untouched_after_notes"] = snapshot(base) == before

    # 5. a full disk (a real EFBIG from the kernel: a file-size limit on process 1) mid-save
    before = snapshot(base / "run" / "ckpt")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if engine.process_index == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        out["refused"]["disk full"] = _error(lambda: engine.save_state("ckpt"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["previous_kept_after_disk_full"] = snapshot(base / "run" / "ckpt") == before
    out["listing_after_disk_full"] = sorted(os.listdir("."))
    engine.load_state("ckpt")  # the previous checkpoint still loads

    # 6. AdamW state into SGD: one line naming the key and the fix
    other = engine_for()
    sgd_model = other.prepare(W.build("gpt2"))
    other.prepare(torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9))
    out["refused"]["adamw into sgd"] = _error(lambda: other.load_state("ckpt"))

    # 7. 16 flipped bytes in a tensor shard (same size): refused on load, naming the file
    engine.save_state("flipped")
    if main:
        _flip(max(Path("flipped").glob("*.distcp"), key=lambda p: p.stat().st_size))
    engine.wait_for_everyone()
    out["refused"]["flipped shard"] = _error(lambda: engine.load_state("flipped"))
    return out


REFUSALS = {  # case -> what the one line must say
    "shadow": "foreign/model.safetensors: was not written by shardwise and would shadow the sharded weights",
    "save_model onto a file": "outputs/results.txt: is a file, not a folder",
    "foreign folder": "outputs: holds files that are not a shardwise checkpoint (config.json, "
                      "model.safetensors, "
                      "results.txt and 1 more)",
    "file": "outputs/results.txt: is a file, not a checkpoint; nothing was written",
    "cwd": "run: is the current directory; save into a subfolder",
    "parent of cwd": "..: is the current directory or holds it",
    "empty cwd": "empty: is the current directory",
    "checkpoint with a user's file": "ckpt_with_notes: holds files that are not a shardwise checkpoint "
                                     "(.metadata",
    "disk full": "ckpt: could not write the checkpoint's tensors: File too large",
    "adamw into sgd": "ckpt: optimizer 0 (SGD) needs '",
    "flipped shard": "flipped/__",
}


def _save_model_keeps_the_users_files(runs: list[dict[str, Any]], folder: Path) -> None:
    out = runs[0]
    assert out["after_save_model"] == ["config.json", "model.safetensors", "results.txt", "tokenizer.json"], \
        f"the folder after save_model: {out['after_save_model']}"
    assert out["user_files"] == USER_FILES
    from safetensors.torch import load_file

    saved = load_file(folder / "run" / "outputs" / "model.safetensors")
    assert all(torch.equal(saved[k], out["weights"][k]) for k in saved)


def _split_then_one_file_again(runs: list[dict[str, Any]], folder: Path) -> None:
    out = runs[0]
    assert ("model.safetensors" not in out["after_split"]
            and "model.safetensors.index.json" in out["after_split"])
    assert ({n for n in out["after_split"] if n.startswith("model-")}
            and "tokenizer.json" in out["after_split"])
    assert out["after_one_file_again"] == out["after_save_model"]


def _refused_in_one_line_alike(case: str) -> Any:
    def check(runs: list[dict[str, Any]], folder: Path) -> None:
        messages = [r["refused"][case] for r in runs]
        assert messages[0] is not None, f"{case}: not refused"
        assert all(m == messages[0] for m in messages), f"{case}: processes disagree: {messages}"
        assert "\n" not in messages[0] and REFUSALS[case] in messages[0], (case, messages[0])
    return check


def _the_refusals_say_the_fix(runs: list[dict[str, Any]], folder: Path) -> None:
    refused = runs[0]["refused"]
    assert "checksum mismatch" in refused["flipped shard"] and ".distcp" in refused["flipped shard"]
    assert "raise it, or save elsewhere" in refused["disk full"]
    assert "; it needs " in refused["disk full"] and " bytes)" in refused["disk full"]  # the bytes needed
    assert "prepare AdamW as when it was saved" in refused["adamw into sgd"]


def _nothing_lost_or_left_behind(runs: list[dict[str, Any]], folder: Path) -> None:
    from shardwise.checkpoint.sharded import verify

    out = runs[0]
    assert out["untouched_after_refusals"] and out["untouched_after_notes"]
    assert out["previous_kept_after_disk_full"]
    for listing in (out["listing_after_resaves"], out["listing_after_disk_full"]):
        assert not [n for n in listing if n.startswith(".")], listing  # no .old, no .incomplete
    assert (folder / "run" / "ckpt_with_notes" / "notes.txt").read_text() == "lr sweep 3"
    assert len(verify(folder / "run" / "ckpt")) >= 5


# one check per careless-user scenario (shared by both engines' tests: test_deepspeed.py)
CARELESS = {
    "save_model keeps the user's files": _save_model_keeps_the_users_files,
    "split into shards, then one file again": _split_then_one_file_again,
    **{f"refused: {case}": _refused_in_one_line_alike(case) for case in REFUSALS},
    "refusals say the fix": _the_refusals_say_the_fix,
    "nothing lost or left behind": _nothing_lost_or_left_behind,
}


@pytest.fixture(scope="module")
def careless(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    folder = tmp_path_factory.mktemp("careless")
    return spawn(careless_user, 2, "torch", str(folder)), folder


def test_planted_export_clears_the_folder_is_caught(tmp_path: Path) -> None:
    """`export_clears_the_folder`: save_model removes every file it does not write; the user's
    tokenizer and results are gone, which the scenario's check refuses."""
    runs = spawn(planted(_hugging_face_pattern_only, "export_clears_the_folder"), 2, str(tmp_path))
    caught(_save_model_keeps_the_users_files, runs, tmp_path,
           must=r"^the folder after save_model: \['config\.json', 'model\.safetensors'\]")


@pytest.mark.parametrize("scenario", list(CARELESS))
def test_careless_user_loses_nothing(careless: tuple[list[dict[str, Any]], Path], scenario: str) -> None:
    CARELESS[scenario](*careless)


def test_export_refuses_a_corrupted_checkpoint_and_keeps_user_files(
    careless: tuple[list[dict[str, Any]], Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from shardwise import cli

    run = careless[1] / "run"
    out = tmp_path / "exported"
    out.mkdir()
    (out / "README.md").write_text("my model card")
    assert cli.main(["export", str(run / "flipped"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checksum mismatch" in err and ".distcp" in err, err
    assert sorted(os.listdir(out)) == ["README.md"]  # refused before anything was written
    assert cli.main(["export", str(run / "ckpt"), str(out), "--max-shard-size", "40KB"]) == 0
    assert cli.main(["export", str(run / "ckpt"), str(out)]) == 0  # re-export: our shards replaced
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "my model card"
    assert cli.main(["verify", str(out)]) == 0


@pytest.mark.parametrize("where", ["model.safetensors", "config.json", "shard"])
def test_verify_finds_flipped_bytes_in_an_export(careless: tuple[list[dict[str, Any]], Path], tmp_path: Path,
                                                 where: str) -> None:
    check_flipped_bytes_found(careless[1], tmp_path, where)


def test_planted_tensor_checksum_unchecked_is_caught(careless: tuple[list[dict[str, Any]], Path],
                                                     tmp_path: Path) -> None:
    """`tensor_checksum_unchecked`: verify reads the recorded checksum and never hashes the
    tensors; a flipped byte in model.safetensors goes unnoticed."""
    with planted_here("tensor_checksum_unchecked"):
        caught(check_flipped_bytes_found, careless[1], tmp_path, "model.safetensors",
               must=r"DID NOT RAISE .*CheckpointError")


def check_flipped_bytes_found(folder: Path, tmp_path: Path, where: str) -> None:
    from shardwise import cli
    from shardwise.checkpoint.sharded import CheckpointError, verify

    out = tmp_path / "exported"
    split = where == "shard"
    assert cli.main(["export", str(folder / "run" / "ckpt"), str(out),
                     *(["--max-shard-size", "40KB"] * split)]) == 0
    assert len(verify(out)) >= 2
    victim = min(out.glob("model-*.safetensors")) if split else out / where
    if where == "config.json":
        victim.write_text(victim.read_text().replace('"n_layer": 2', '"n_layer": 3'))
    else:
        _flip(victim)
    with pytest.raises(CheckpointError) as err:
        verify(out)
    assert str(err.value).startswith(str(victim)) and "\n" not in str(err.value)


# -- SIGKILL in the middle of save_model ----------------------------------------------------------
def check_model_folder_whole(tmp_path: Path) -> None:
    """After a save_model killed halfway: the earlier save whole (it verifies and loads), nothing
    partial in the folder, what the killed save staged beside it."""
    from transformers import GPT2LMHeadModel

    from shardwise.checkpoint.sharded import CheckpointError, verify

    target = tmp_path / "outputs"
    assert sorted(os.listdir(target)) == [
        "config.json", "model.safetensors", "tokenizer.json"]  # nothing partial
    try:
        checked = verify(target)
    except CheckpointError as err:
        raise AssertionError(f"the earlier save does not verify: {err}") from None
    assert len(checked) == 2  # the earlier save, whole
    GPT2LMHeadModel.from_pretrained(target)
    assert (tmp_path / ".outputs.incomplete").is_dir()  # what the killed save staged, beside the folder


def test_planted_export_in_place_is_caught(tmp_path: Path) -> None:
    """`export_in_place`: save_model writes into the folder itself; the kill leaves a half file."""
    with pytest.raises(RuntimeError, match=r"exited with|worker failed"):
        spawn(planted(_killed_in_save_model, "export_in_place"), 2, str(tmp_path), timeout=300)
    caught(check_model_folder_whole, tmp_path,
           must=r"^the earlier save does not verify: \S*model\.safetensors: truncated or padded "
                r"\(\d+ bytes, its header says \d+\)")



def _killed_in_save_model(folder: str) -> None:
    import shardwise
    import shardwise.weights.export as writer

    engine = shardwise.Engine(strategy="zero2", cpu=True, seed=W.SEED)
    model, _ = W.one_step(engine, "gpt2")
    target = Path(folder) / "outputs"
    engine.save_model(model, target)  # the model the user keeps
    if engine.is_main_process:
        (target / "tokenizer.json").write_text(USER_FILES["tokenizer.json"])
    engine.wait_for_everyone()
    real = writer._write_shard

    def half_then_die(tensors: Any, path: Path, extra: Any) -> str:
        real(tensors, path, extra)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # killed halfway through the file
        os.kill(os.getpid(), signal.SIGKILL)
        return ""

    writer._write_shard = half_then_die
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # new weights, so a half-landed save would show
    engine.save_model(model, target)


def _save_again(folder: str) -> None:
    import shardwise

    engine = shardwise.Engine(strategy="zero2", cpu=True, seed=W.SEED)
    model, _ = W.one_step(engine, "gpt2")
    engine.save_model(model, Path(folder) / "outputs")


def test_sigkill_during_save_model_leaves_the_folder_whole(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited with|worker failed"):
        spawn(_killed_in_save_model, 2, str(tmp_path), timeout=300)
    target = tmp_path / "outputs"
    check_model_folder_whole(tmp_path)
    spawn(_save_again, 2, str(tmp_path))
    assert not (tmp_path / ".outputs.incomplete").exists()  # the next save to the same place cleared it
    assert sorted(os.listdir(tmp_path)) == ["outputs"]
    assert (target / "tokenizer.json").read_text() == USER_FILES["tokenizer.json"]

