"""Issue 33: transformers' `run_*_no_trainer.py` pattern (tests/accelerate_scripts/no_trainer.py,
one task each: causal LM, masked LM with tied embeddings, sequence and token classification, T5
translation evaluated with `generate`) runs to the end with only its import changed, under
Accelerate itself (the reference), shardwise ddp and zero3, 2 CPU processes each:
- losses and learning rates equal Accelerate's (relative 1e-5 under ddp, 1e-4 under zero3), and
  so do the metrics (perplexity, accuracy over the de-duplicated evaluation set);
- the scripts' last lines, `unwrap_model(model).save_pretrained(dir, is_main_process=...,
  save_function=accelerator.save)` on every process, write a folder with Accelerate's keys (a
  tied head written once), which `from_pretrained` reloads in a plain process with the trained
  model's logits on a probe (1e-5);
- `accelerator.state` prints as Accelerate's does (its text, not an object address).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("accelerate")  # the reference; installed by `make test` (the test extra)
from planted import caught, fault_env
from test_accelerate_scripts import HERE, _run, _swapped

SCRIPT = "no_trainer.py"
TASKS = ["clm", "mlm", "glue", "ner", "translation"]


def _launch(script: Path, tmp: Path, task: str, label: str, config: str | None,
            fault: str | None = None) -> dict[str, Any]:
    """The run's results; it must exit 0 with results written after `end_training()` (`_run`),
    but for Accelerate's own (`reference`), which may hang in gloo's teardown after them."""
    out = _run(script, tmp, f"{task}-{label}", config, "--task", task, "--output_dir",
               str(tmp / f"{task}-{label}-saved"), reference=script == HERE / SCRIPT,
               env=fault_env(fault) if fault else None)
    out["saved"] = tmp / f"{task}-{label}-saved"
    return out


def _keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _reloaded_logits(folder: Path, task: str) -> torch.Tensor:
    import importlib.util
    import json

    import transformers

    spec = importlib.util.spec_from_file_location("no_trainer", HERE / SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(str(folder))
    model.eval()
    with torch.no_grad():
        return model(**module.probe(task)).logits


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("task", TASKS)
def test_no_trainer_script_runs_to_the_end_with_accelerates_numbers(tmp_path: Path, task: str) -> None:
    ours = _swapped(SCRIPT, tmp_path)
    ref = _launch(HERE / SCRIPT, tmp_path, task, "accelerate", None)
    ref_keys = _keys(ref["saved"])
    assert ref["state"].startswith("Distributed environment: DistributedType.MULTI_CPU")
    for strategy, rel in (("ddp", 1e-5), ("zero3", 1e-4)):
        got = _launch(ours, tmp_path, task, strategy, f"strategy: {strategy}\n")
        check_like_accelerate(got, ref, ref_keys, strategy, rel, task)


def test_planted_script_metrics_keep_repeats_is_caught(tmp_path: Path) -> None:
    """`script_metrics_keep_repeats`: gather_for_metrics keeps the samples the loader repeated to
    even out its last evaluation batch; the sequence classifier's metrics leave Accelerate's."""
    ref = _launch(HERE / SCRIPT, tmp_path, "glue", "accelerate", None)
    got = _launch(_swapped(SCRIPT, tmp_path), tmp_path, "glue", "ddp", "strategy: ddp\n",
                  fault="script_metrics_keep_repeats")
    caught(check_like_accelerate, got, ref, _keys(ref["saved"]), "ddp", 1e-5, "glue",
           must=r"^ddp: 18 evaluation samples counted, Accelerate 13")


def check_like_accelerate(got: dict[str, Any], ref: dict[str, Any], ref_keys: set[str], strategy: str,
                          rel: float, task: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == 16  # 2 epochs x 8 batches per process
    bad = [(a, b) for a, b in zip(got["losses"], ref["losses"]) if not _close(a, b, rel)]
    assert not bad, f"{strategy}: losses differ from Accelerate's: {bad[:3]}"
    assert got["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
    for g, r in zip(got["metrics"], ref["metrics"], strict=True):
        assert g["n"] == r["n"], f"{strategy}: {g['n']} evaluation samples counted, Accelerate {r['n']}"
        for key in set(r) - {"n"}:
            assert _close(g[key], r[key], rel), (strategy, key, g[key], r[key])
    # the every-process save_pretrained: Accelerate's keys, reloaded with the trained logits
    assert _keys(got["saved"]) == ref_keys, strategy
    reloaded = _reloaded_logits(got["saved"], task)
    torch.testing.assert_close(reloaded, torch.tensor(got["probe"]), rtol=1e-5, atol=1e-5)
    kind = "MULTI_CPU" if strategy == "ddp" else "FSDP"
    lines, want = got["state"].splitlines(), ref["state"].replace("MULTI_CPU", kind).splitlines()
    device = [i for i, line in enumerate(want) if line.startswith("Device: ")]
    assert [x for i, x in enumerate(lines) if i not in device] == [x for i, x in enumerate(want)
                                                                   if i not in device], got["state"]
    assert all(lines[i].startswith("Device: cpu") for i in device), got["state"]  # Accelerate: cpu:0
