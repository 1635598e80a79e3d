"""TRL's trainers, unchanged, on shardwise: tests/trainer_scripts/sft.py, dpo.py and grpo.py
(TRL's own scripts' shape, a tiny Qwen2 and data made in code, nothing naming shardwise) run under
Accelerate itself (the reference: torchrun with ACCELERATE_USE_CPU=1, 2 CPU processes) and as they
are under `shardwise launch --num-processes 2 --config X.yaml` (the Trainer put on shardwise by
`shardwise.trainer.run`) at ddp, zero3, and zero3 on DeepSpeed (`backend: deepspeed`). SFT runs
with packing too (zero3). The scripts use fp32 and TRL's default gradient checkpointing; GRPO
generates with the model itself (`use_vllm=False`, TRL's default).

Checked per run, against the reference run of the same script and flags:
- every entry of the Trainer's log history, each number in it (loss, grad_norm, learning_rate,
  entropy, mean_token_accuracy, num_tokens; DPO's rewards/*, logps/*, logits/*; GRPO's reward,
  reward_std, completion lengths, clip ratios; every eval_* entry, eval_loss among them; the final
  evaluation): |ours - Accelerate's| <= 1e-5 x |Accelerate's| + 1e-6. The absolute 1e-6 is for the
  values that are differences of nearly equal numbers (DPO's rewards are beta x (logp - ref logp) of
  logps near -30, its logits/* means of logits of both signs, GRPO's loss on groups of equal-length
  completions cancels to ~1e-8): 1e-5 relative to such a value is below what fp32 round-off moves
  it by. Timings (runtime, per-second rates, step_time) are not compared, nor total_flos under
  DeepSpeed (its ZeRO-3 leaves each parameter empty in the module, so transformers counts 0, as
  under Accelerate's DeepSpeed). Measured (2 CPU cores): ddp equals Accelerate bitwise; zero3
  within 1.2e-7 relative (grad_norm; loss 1.1e-7, the rest bitwise or below); zero3 on DeepSpeed
  within 1.7e-7 relative (DPO's loss) and 1.4e-7 absolute (DPO's rewards; its logits 4e-8). The
  test prints each run's largest differences (`pytest -s`).
- the Accelerator is shardwise's (`shardwise.trainer.accelerator.TrainerAccelerator`), and the run
  said so with its config (the start-up line);
- each rank's parameter bytes at every step: the whole model (Accelerate's) under ddp, exactly half
  of it under zero3, for the policy and for DPO's reference model;
- DPO's reference model: its weights' checksum after training equals the one before (and the
  policy's changed).

One reference run per script and flags (module-scoped), reused across the strategies.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from planted import caught, fault_env
from spawn import GLOO_ABORT
from test_accelerate_scripts import _launch, _results

pytest.importorskip("accelerate")  # the reference; installed by `make test` (the test extra)
pytest.importorskip("trl")

HERE = Path(__file__).parent / "trainer_scripts"
REL, ABS = 1e-5, 1e-6
SHARDWISE = "shardwise.trainer.accelerator.TrainerAccelerator"
NOT_COMPARED = ("runtime", "per_second", "step_time")

SCRIPTS: dict[str, tuple[str, tuple[str, ...]]] = {  # label -> (script, flags)
    "sft": ("sft.py", ()),
    "sft_packed": ("sft.py", ("--packing",)),
    "dpo": ("dpo.py", ()),
    "grpo": ("grpo.py", ()),
}
CONFIGS = {
    "ddp": "strategy: ddp\n",
    "zero3": "strategy: zero3\n",
    "zero3_deepspeed": "strategy: zero3\nbackend: deepspeed\n",
}
_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (pip install 'shardwise[deepspeed]')")
CASES = [
    pytest.param(script, config, id=f"{script}-{config}",
                 marks=[_DEEPSPEED] if config == "zero3_deepspeed" else [])
    for script, config in [
        ("sft", "ddp"), ("sft", "zero3"), ("sft", "zero3_deepspeed"),
        ("sft_packed", "zero3"),  # (packing: the same loop on other batches; ddp adds nothing here)
        ("dpo", "ddp"), ("dpo", "zero3"), ("dpo", "zero3_deepspeed"),
        ("grpo", "ddp"), ("grpo", "zero3"), ("grpo", "zero3_deepspeed"),
    ]
]


def _run(tmp: Path, label: str, script: str, flags: tuple[str, ...], config: str | None,
         timeout: float = 300, base_env: dict[str, str] | None = None) -> tuple[dict, str]:
    """The results (`--out`) and stderr of `script` on 2 processes: under Accelerate (`config`
    None: torchrun, ACCELERATE_USE_CPU=1) or `shardwise launch --config`. The run must exit 0 with
    results that say it finished; as in test_accelerate_scripts, Accelerate's own run may abort
    or hang in gloo's teardown after its results (counted), and a gloo abort before any results
    is run once more (said)."""
    out = tmp / f"{label}.json"
    env = {**(os.environ if base_env is None else base_env), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("SHARDWISE_CONFIG", None)
    args = [str(HERE / script), "--output_dir", str(tmp / label), "--out", str(out), *flags]
    if config is None:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    else:
        env.pop("ACCELERATE_USE_CPU", None)
        cfg = tmp / f"{label}.yaml"
        cfg.write_text(config)
        cmd = [sys.executable, "-m", "shardwise", "launch", "--num-processes", "2", "--config", str(cfg),
               *args]
    for attempt in (1, 2):
        out.unlink(missing_ok=True)
        code, err = _launch(cmd, env, timeout)
        results = _results(out)
        finished = bool(results and results.get("done"))
        if config is None and finished and (code is None or (code != 0 and GLOO_ABORT in err)):
            print(f"{label}: Accelerate's known teardown fault after complete results; counted")
            return results, err  # type: ignore[return-value]
        if code is None:
            pytest.fail(f"{label}: still running after {timeout} s (a hang)\n{err[-4000:]}")
        if code != 0 and GLOO_ABORT in err and results is None and attempt == 1:
            message = f"{label}: gloo aborted at start-up (before any results), run once more"
            print(message)
            warnings.warn(message, stacklevel=2)
            continue
        assert code == 0, f"{label}: exited {code}\n{err[-4000:]}"
        assert finished, f"{label}: exited 0 but its results do not say it finished\n{err[-4000:]}"
        return results, err  # type: ignore[return-value]
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """Accelerate's run of a script (by SCRIPTS label), run once in this module."""
    tmp = tmp_path_factory.mktemp("trl_reference")
    runs: dict[str, dict] = {}

    def get(label: str) -> dict:
        if label not in runs:
            script, flags = SCRIPTS[label]
            runs[label], _ = _run(tmp, f"{label}-accelerate", script, flags, None)
            assert runs[label]["accelerator"] == "accelerate.accelerator.Accelerator"
        return runs[label]

    return get


def _numbers(entry: dict[str, Any], deepspeed: bool) -> dict[str, float]:
    return {k: v for k, v in entry.items()
            if isinstance(v, (int, float)) and not any(word in k for word in NOT_COMPARED)
            and not (deepspeed and k == "total_flos")}


def check_logs(got: dict, ref: dict, label: str, deepspeed: bool = False) -> dict[str, float]:
    """Every logged number equal to Accelerate's within REL/ABS; returns the largest difference
    per metric (relative, or absolute where the reference is below ABS/REL)."""
    assert got["global_step"] == ref["global_step"], label
    history = [*got["log_history"], *([got["eval"]] if "eval" in got else [])]
    expected = [*ref["log_history"], *([ref["eval"]] if "eval" in ref else [])]
    assert len(history) == len(expected), f"{label}: {len(history)} log entries, Accelerate {len(expected)}"
    worst: dict[str, float] = {}
    bad = []
    for i, (a, b) in enumerate(zip(history, expected, strict=True)):
        x, y = _numbers(a, deepspeed), _numbers(b, deepspeed)
        assert x.keys() == y.keys(), f"{label}: entry {i}: {sorted(x.keys() ^ y.keys())} unlike Accelerate's"
        for key, want in y.items():
            diff = abs(x[key] - want)
            if diff > REL * abs(want) + ABS:
                bad.append((i, key, x[key], want))
            scale = abs(want) if abs(want) * REL > ABS else 1.0
            worst[key] = max(worst.get(key, 0.0), diff / scale)
    assert not bad, f"{label}: logged values differ from Accelerate's: {bad[:5]}"
    return worst


def check_held(got: dict, ref: dict, label: str, sharded: bool) -> None:
    """Each rank's parameter bytes at every step: Accelerate's whole model, halved under zero3."""
    for model in ref["held"]["0"]:
        whole = set(ref["held"]["0"][model]) | set(ref["held"]["1"][model])
        assert len(whole) == 1, (label, model, whole)
        (full,) = whole
        for rank in ("0", "1"):
            held = got["held"][rank][model]
            assert len(held) == ref["global_step"], (label, model, rank)
            assert set(held) == {full // 2 if sharded else full}, (
                f"{label}: rank {rank} holds {sorted(set(held))} bytes of the {model}; "
                f"Accelerate's whole {full}, {'half' if sharded else 'all'} expected")


@pytest.mark.parametrize(("script", "config"), CASES)
def test_trl_script_gives_accelerates_numbers(tmp_path: Path, reference: Callable[[str], dict],
                                              script: str, config: str) -> None:
    ref = reference(script)
    name, flags = SCRIPTS[script]
    deepspeed = config == "zero3_deepspeed"
    got, err = _run(tmp_path, f"{script}-{config}", name, flags, CONFIGS[config],
                    timeout=600 if deepspeed else 300)  # (a first DeepSpeed run compiles its ops)
    trainer = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer"}[name.removesuffix(".py")]
    strategy = "zero3" if config.startswith("zero3") else config
    said = (f"shardwise: {trainer} runs on shardwise's Accelerator: strategy {strategy}, fp32, "
            f"{'deepspeed' if deepspeed else 'torch'} backend, 2 process(es)")
    assert said in err, f"{script}-{config}: no start-up line {said!r}\n{err[-2000:]}"
    assert got["accelerator"] == SHARDWISE
    worst = check_logs(got, ref, f"{script}-{config}", deepspeed)
    print(f"{script}-{config}: largest differences from Accelerate: "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items()) if v))
    check_held(got, ref, f"{script}-{config}", sharded=strategy == "zero3")
    if script == "dpo":
        assert got["before"] == ref["before"] and got["before"]["model"] == got["before"]["ref_model"]
        assert got["after"]["ref_model"] == got["before"]["ref_model"], "the reference model changed"
        assert got["after"]["model"] != got["before"]["model"], "the policy did not train"


def test_scripts_do_not_name_shardwise() -> None:
    """The scripts run as users run TRL's: their code (their docstrings aside) never names
    shardwise, neither in an import nor in a string or a name."""
    for name in ("sft.py", "dpo.py", "grpo.py", "tiny_lm.py"):
        tree = ast.parse((HERE / name).read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            text = (node.value if isinstance(node, ast.Constant) and id(node) not in docstrings
                    and isinstance(node.value, str) else node.id if isinstance(node, ast.Name)
                    else node.attr if isinstance(node, ast.Attribute)
                    else " ".join(a.name for a in node.names) + " " + (getattr(node, "module", "") or "")
                    if isinstance(node, (ast.Import, ast.ImportFrom)) else "")
            assert "shardwise" not in text.lower(), (name, getattr(node, "lineno", None), text)


def test_planted_trl_reference_left_whole_is_caught(tmp_path: Path, reference: Callable[[str], dict]) -> None:
    """`trl_reference_left_whole`: a model prepared for evaluation only (DPO's frozen reference)
    comes back unprepared, whole on every rank under zero3; the bytes check names it."""
    ref = reference("dpo")
    name, flags = SCRIPTS["dpo"]
    got, _ = _run(tmp_path, "dpo-planted", name, flags, CONFIGS["zero3"],
                  base_env=fault_env("trl_reference_left_whole"))
    caught(check_held, got, ref, "dpo-planted", sharded=True,
           must=r"rank 0 holds \[\d+\] bytes of the ref_model; Accelerate's whole \d+, half expected")
