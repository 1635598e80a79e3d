"""The three example workloads run end to end through `shardwise launch` at their tiny size, and
the classifier reaches the same accuracy and F1 under ddp and zero1.

Tolerance for the metric equality: the three runs train numerically equivalent models (see
test_equivalence: weights within ~1e-6), so their predictions agree except for an eval pair
sitting on the decision boundary: accuracy within one of the 203 pairs, F1 within 0.01.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
from planted import caught, fault_env
from spawn import run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _launch(config: str, script: str, *args: str, cwd: Path, fault: str | None = None) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("SHARDWISE_CONFIG", None)
    cmd = [sys.executable, "-m", "shardwise", "launch", "--config", str(EXAMPLES / "configs" / config),
           "--cpu", str(EXAMPLES / script), *args]
    proc = run_command(cmd, cwd=cwd, env=fault_env(fault, env) if fault else env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr  # the engine's own lines (resumed from ...) go to stderr


@pytest.mark.parametrize(
    ("script", "config", "expect"),
    [
        ("seq2seq.py", "zero3_offload.yaml", "exact-match replies"),
        ("long_context.py", "long_context.yaml",
         "context parallelism ring over 2 process(es) (512 tokens each)"),
        ("moe.py", "moe.yaml", "4 experts per layer split over 2 process(es) (2 each)"),
    ],
)
def test_example_runs(script: str, config: str, expect: str, tmp_path: Path) -> None:
    out = _launch(config, script, "--steps", "6", "--log-every", "3", "--save-every", "3",
                  "--output-dir", str(tmp_path / "model"), cwd=tmp_path)
    assert expect in out and "step     6" in out
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_6"
    assert any((tmp_path / "model").glob("*.safetensors")) and (tmp_path / "model" / "config.json").is_file()


def test_example_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """causal_lm.py under zero2, then resumed under zero3 to the end: perplexity and export."""
    _launch("zero2.yaml", "causal_lm.py", "--steps", "4", "--save-every", "4", cwd=tmp_path)
    out = _launch("zero3.yaml", "causal_lm.py", "--steps", "6", "--resume", "--log-every", "1",
                  "--save-every", "3", "--output-dir", str(tmp_path / "model"), cwd=tmp_path)
    assert "resumed from checkpoints/step_4 at step 4" in out
    assert "step     5" in out and "step     1 " not in out
    assert "perplexity" in out and (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_6"
    assert any((tmp_path / "model").glob("*.safetensors")) and (tmp_path / "model" / "config.json").is_file()


def test_classification_metrics_equal_across_strategies(tmp_path: Path) -> None:
    metrics = {}
    for strategy in ("ddp", "zero1"):  # (classification.py's run under a launch config: this test)
        out = tmp_path / f"{strategy}.json"
        _launch(f"{strategy}.yaml", "classification.py", "--metrics-out", str(out), cwd=tmp_path)
        metrics[strategy] = json.loads(out.read_text())
    ddp = metrics["ddp"]
    assert ddp["n"] == 203 and ddp["accuracy"] > 0.7  # it learned (15% of labels are noise)
    for strategy in ("zero1",):
        assert abs(metrics[strategy]["accuracy"] - ddp["accuracy"]) <= 1 / 203 + 1e-9, metrics
        assert abs(metrics[strategy]["f1"] - ddp["f1"]) <= 0.01, metrics


def test_finetune_lora_example(tmp_path: Path) -> None:
    """finetune_lora.py under zero3: token-weighted LoRA steps, generate() evals, the adapter saved."""
    check_lora_example(tmp_path)


def test_planted_adapter_b_dropped_is_caught(tmp_path: Path) -> None:
    """`adapter_b_dropped`: the export writes lora_A alone; the folder loads as the base model."""
    caught(check_lora_example, tmp_path, "adapter_b_dropped", must=r"lora_B of 0 of the 8 adapted modules")


def check_lora_example(tmp_path: Path, fault: str | None = None) -> None:
    """The run logs its steps and evals, and the adapter folder holds what training made: lora_A
    and lora_B of each of the 8 adapted modules (2 blocks x c_attn, attn.c_proj, c_fc,
    mlp.c_proj), each B trained away from its zero start."""
    from safetensors.torch import load_file

    out = _launch("zero3.yaml", "finetune_lora.py", "--steps", "4", "--eval-every", "2",
                  "--output-dir", str(tmp_path / "adapter"), cwd=tmp_path, fault=fault)
    assert "eval step     2" in out and "eval step     4" in out and "step     4  loss" in out
    saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert saved == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    a = [k for k in tensors if ".lora_A." in k]
    b = [k for k in tensors if ".lora_B." in k and tensors[k].abs().max() > 0]
    assert len(a) == 8 and len(b) == 8, \
        f"lora_A of {len(a)} and trained lora_B of {len(b)} of the 8 adapted modules"


def _corpus(path: Path, words: int = 6000) -> Path:
    """A fixed text made here: sentences of words drawn from a small vocabulary with a seeded
    generator (the same bytes on every machine and at every commit)."""
    rng = random.Random(0)
    words_used = ("the model shard step loss rank batch every process gathers its own block weights "
             "optimizer state memory one two four gradient checkpoint resume train plain sharded "
             "mesh data parallel tensor reference policy frozen reply chosen rejected")
    vocab = words_used.split()
    sentences, n = [], 0
    while n < words:
        k = rng.randint(4, 12)
        sentence = " ".join(rng.choice(vocab) for _ in range(k))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        n += k
    path.write_text(" ".join(sentences) + "\n")
    return path


def test_dpo_example_trains_a_policy_beside_a_frozen_reference(tmp_path: Path) -> None:
    """examples/dpo.py under zero3: the frozen reference prepared alone, the DPO loss falls."""
    check_dpo_falls(tmp_path)


def test_planted_optimizer_bound_by_name_is_caught(tmp_path: Path) -> None:
    """`optimizer_bound_by_name`: the policy's optimizer rebound by name to the reference (a copy
    of the policy, prepared first); the policy never moves and the loss check fails."""
    caught(check_dpo_falls, tmp_path, "optimizer_bound_by_name",
           must=r"^dpo losses logged \[0\.6\d+, 0\.6\d+, 0\.6\d+\]: the last not below 0\.6")


def check_dpo_falls(tmp_path: Path, fault: str | None = None) -> None:
    text = _corpus(tmp_path / "corpus.txt")  # not the repository's own text: that moves with every edit
    out = _launch("zero3.yaml", "dpo.py", "--steps", "6", "--log-every", "2", "--text", str(text),
                  cwd=tmp_path, fault=fault)
    assert "policy + frozen reference, zero3 on 2 process(es)" in out, out[-2000:]
    losses = [float(x) for x in re.findall(r"dpo loss (\d+\.\d+)", out)]
    # policy = reference at the start: log 2 = 0.6931, give or take the policy's dropout (on this
    # text a run whose policy never moves logs 0.6923, 0.6979, 0.6824); trained, 0.6726, 0.6170, 0.4857
    assert len(losses) == 3 and losses[-1] < 0.6, f"dpo losses logged {losses}: the last not below 0.6"
