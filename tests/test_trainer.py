"""transformers' `Trainer` scripts run unchanged on shardwise, with Accelerate's numbers.

tests/trainer_scripts/train_clm.py (a causal-LM fine-tuning script in the shape of run_clm.py:
gradient accumulation 2, clipping at 0.5, a linear schedule with warmup, checkpoints, evaluation,
predict, save_model; nothing in it names shardwise) runs under Accelerate (the reference:
torchrun, ACCELERATE_USE_CPU=1, 2 processes: Accelerate's DDP) and unchanged under
`shardwise launch --num-processes 2 --config X.yaml` at ddp, zero2, zero3, hybrid zero3 (2 replicas
of one shard), zero3 with offload,
zero3 from the script's own `TrainingArguments(fsdp=...)` and DeepSpeed's ZeRO-3 from its own
`TrainingArguments(deepspeed=ds.json)`.

Tolerances (fp32; bf16 below): every logged loss and gradient norm, the eval and predict losses within 1e-5
relative of the reference's (measured: 0 for ddp, up to 1e-7 for zero3 and DeepSpeed, the
reduction's order); the saved model's weights within 1e-5 absolute (measured up to 6e-8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from planted import caught, fault_env
from safetensors.torch import load_file
from spawn import GLOO_ABORT, kill_tree

pytest.importorskip("accelerate")  # the reference; installed by `make test` (the test extra)
pytest.importorskip("transformers")

SCRIPT = Path(__file__).parent / "trainer_scripts" / "train_clm.py"
REL = 1e-5  # losses, gradient norms (measured up to 1e-7)
# bf16 compute: Accelerate autocasts, shardwise casts the parameters (fp32 masters either way)
BF16_REL, BF16_NORM_REL = 1e-4, 5e-3  # losses, gradient norms (measured 2.0e-5, 1.5e-3)
WEIGHTS = 1e-5  # the saved model, absolute (measured up to 6e-8)
OURS = "shardwise.trainer.accelerator.TrainerAccelerator"
DS_JSON = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1", **(extra or {})}
    env.pop("SHARDWISE_CONFIG", None)
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def launch(tmp: Path, label: str, config: str | None, *flags: str, reference: bool = False,
           nproc: int = 2, env: dict[str, str] | None = None, expect_ok: bool = True,
           timeout: float = 300) -> tuple[dict[str, Any] | None, str]:
    """train_clm.py on `nproc` processes: under Accelerate (`reference`) or `shardwise launch`
    with `config` (None: no --config). Returns its results (None when it wrote none) and stderr.
    A hang fails; gloo's start-up abort before any results is run once more, said so."""
    out, outdir = tmp / f"{label}.json", tmp / label
    env = _env(env) if env is None else {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script_args = [str(SCRIPT), "--output_dir", str(outdir), "--out", str(out), *flags]
    if reference:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    else:
        cmd = [sys.executable, "-m", "shardwise", "launch", "--num-processes", str(nproc)]
        if config is not None:
            cfg = tmp / f"{label}.yaml"
            cfg.write_text(config)
            cmd += ["--config", str(cfg)]
    for attempt in (1, 2):
        out.unlink(missing_ok=True)
        proc = subprocess.Popen([*cmd, *script_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            _, err = proc.communicate()
            pytest.fail(f"{label}: still running after {timeout} s (a hang)\n{err[-4000:]}")
        results = json.loads(out.read_text()) if out.is_file() else None
        if proc.returncode != 0 and GLOO_ABORT in err and results is None and attempt == 1:
            warnings.warn(f"{label}: gloo aborted at start-up (before any results), run once more",
                          stacklevel=2)
            continue
        if expect_ok:
            assert proc.returncode == 0, f"{label}: exited {proc.returncode}\n{err[-4000:]}"
            assert results is not None, f"{label}: exited 0 without results\n{err[-4000:]}"
        return results, err
    raise AssertionError("unreachable")


def _logged(results: dict[str, Any], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in results["log_history"] if key in row]


def check_numbers(got: dict[str, Any], ref: dict[str, Any], label: str, *, steps: tuple[int, int] = (1, 6),
                  after_training: bool = True, evals: bool = True, rel: float = REL,
                  norm_rel: float = REL) -> None:
    """Every logged loss and gradient norm of steps[0]..steps[1], and the eval losses, as the
    reference's (REL); the run was shardwise's. `after_training=False`: not the script's evaluate
    after `train()` (the last row: a best model loaded at the end makes it another model's)."""
    assert got["accelerator"] == OURS, f"{label}: the Trainer ran on {got['accelerator']}, not shardwise"
    for key in ("grad_norm", "loss", "learning_rate", *(("eval_loss", "eval_accuracy") if evals else ())):
        last = None if after_training or key != "eval_loss" else -1
        mine = [(s, v) for s, v in _logged(got, key)[:last] if steps[0] <= s <= steps[1]]
        theirs = [(s, v) for s, v in _logged(ref, key)[:last] if steps[0] <= s <= steps[1]]
        assert [s for s, _ in mine] == [s for s, _ in theirs], f"{label}: {key} logged at other steps"
        for (step, a), (_, b) in zip(mine, theirs):
            bound = norm_rel if key == "grad_norm" else rel
            assert a == pytest.approx(b, rel=bound, abs=1e-12), (
                f"{label}: {key} at step {step}: {a!r} vs Accelerate's {b!r}")


def check_weights(folder: Path, ref_folder: Path, label: str, name: str = "model.safetensors") -> None:
    mine, theirs = load_file(folder / name), load_file(ref_folder / name)
    assert sorted(mine) == sorted(theirs), f"{label}: other tensor names in {name}"
    worst = max((mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs)
    assert worst <= WEIGHTS, f"{label}: saved weights differ from Accelerate's by {worst:.2e}"


def check_held(got: dict[str, Any], ref: dict[str, Any], label: str, share: float) -> None:
    """Each rank's parameter bytes, read at every step by the script's callback: `share` of the
    whole (Accelerate's DDP holds the whole model on every rank)."""
    whole = ref["held"]["0"][0]
    for rank, held in got["held"].items():
        assert held and all(h == pytest.approx(whole * share, rel=0.02) for h in held), (
            f"{label}: rank {rank} held {held[0]} of {whole} parameter bytes, not {share:.2f} of them")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Accelerate reference and its LoRA twin, made once for the module."""
    tmp = tmp_path_factory.mktemp("trainer")
    ref, _ = launch(tmp, "accelerate", None, reference=True)
    lora, _ = launch(tmp, "accelerate_lora", None, "--lora", reference=True)
    (tmp / "ds.json").write_text(json.dumps(DS_JSON))
    return {"tmp": tmp, "ref": ref, "lora": lora}


# label: (config, script flags, share of the parameters each rank holds)
CASES: dict[str, tuple[str | None, tuple[str, ...], float]] = {
    "ddp": ("strategy: ddp\n", (), 1.0),
    "zero2": ("strategy: zero2\n",
              ("--save_steps", "2", "--save_total_limit", "2", "--report_to", "tensorboard"), 0.5),  # at rest
    "zero3": ("strategy: zero3\n", (), 0.5),
    "hybrid": ("strategy: zero3\nshard_group_size: 1\n", (), 1.0),  # 2 replicas of 1 shard each
    "zero3_offload": ("strategy: zero3\noffload: params\n",
                      ("--load_best_model_at_end", "--greater_is_better"), 0.5),
    "fsdp_arguments": (None, ("--fsdp", "full_shard auto_wrap"), 0.5),
    "deepspeed_arguments": (None, ("--deepspeed", "{tmp}/ds.json"), 0.5),
}


def run_case(runs: dict[str, Any], label: str) -> tuple[dict[str, Any], str]:
    """The case's run, once per module (the resume tests start from zero3's checkpoint-3)."""
    if label not in runs:
        config, flags, _ = CASES[label]
        tmp = runs["tmp"]
        runs[label] = launch(tmp, label, config, *(f.format(tmp=tmp) for f in flags))
    return runs[label]


@pytest.mark.parametrize("label", list(CASES))
def test_a_trainer_script_gives_accelerates_numbers(runs: dict[str, Any], label: str) -> None:
    got, err = run_case(runs, label)
    ref, tmp = runs["ref"], runs["tmp"]
    share = CASES[label][2]
    check_numbers(got, ref, label, after_training=label != "zero3_offload")
    check_held(got, ref, label, share)
    # the first lines say what runs
    assert "runs on shardwise's Accelerator: strategy" in err
    if label == "zero3_offload":  # load_best_model_at_end, the best being step 3's (greater_is_better)
        assert got["best"].endswith("checkpoint-3")
        assert got["eval"]["eval_loss"] == pytest.approx(_logged(ref, "eval_loss")[0][1], rel=REL)
        check_weights(tmp / label / "final", tmp / "accelerate" / "checkpoint-3", label)
    else:
        assert got["eval"]["eval_loss"] == pytest.approx(ref["eval"]["eval_loss"], rel=REL)
        assert got["predict_loss"] == pytest.approx(ref["predict_loss"], rel=REL)
        assert got["predict_accuracy"] == ref["predict_accuracy"]
        check_weights(tmp / label / "final", tmp / "accelerate" / "final", label)
    if label == "zero2":  # save_total_limit=2 with save_steps=2; report_to=tensorboard wrote its events
        assert got["checkpoints"] == ["checkpoint-4", "checkpoint-6"]
        assert list((tmp / label).rglob("events.out.tfevents.*")), "no tensorboard events written"
    else:
        assert got["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    state = tmp / label / got["checkpoints"][0]
    assert (state / "shardwise").is_dir() and (state / "trainer_state.json").is_file()
    if label.startswith("deepspeed"):
        assert "deepspeed backend" in err
    if label == "zero3":  # the checkpoint's sharded state exports offline to the same weights
        from shardwise import cli

        state = tmp / label / "checkpoint-6" / "shardwise"
        assert cli.main(["export", str(state), str(tmp / "exported")]) == 0
        check_weights(tmp / "exported", tmp / "accelerate" / "final", "shardwise export")


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_trainer_checkpoint_resumes_where_the_straight_run_goes(runs: dict[str, Any], nproc: int) -> None:
    """zero3's checkpoint-3 resumed with resume_from_checkpoint ends where the straight zero3 run
    ends: at 2 processes, and at 1 (gradient accumulation 4 keeps the global batch of 8 and its
    samples); steps 4-6 logged as Accelerate's, the same final model. save_total_limit=1 keeps
    the newest checkpoint only."""
    run_case(runs, "zero3")
    tmp, ref = runs["tmp"], runs["ref"]
    label = f"resumed_at_{nproc}"
    accum = str(4 // nproc)
    got, _ = launch(tmp, label, "strategy: zero3\n", "--resume_from_checkpoint",
                    str(tmp / "zero3" / "checkpoint-3"),
                      "--gradient_accumulation_steps", accum, "--save_total_limit", "1", nproc=nproc)
    assert got is not None
    check_resumed(got, ref, label, tmp, nproc)


def check_resumed(got: dict[str, Any], ref: dict[str, Any], label: str, tmp: Path, nproc: int) -> None:
    # steps 1-3 come back from the checkpoint's trainer_state.json; 4-6 are the resumed run's. The
    # eval loss at 1 process is not the 2-process one, under Accelerate too: the Trainer averages
    # each evaluation batch's token mean, and 2 processes make one batch of both ranks' 4 samples
    check_numbers(got, ref, label, steps=(4, 6), evals=nproc == 2)
    assert [s for s, _ in _logged(got, "loss")] == [1, 2, 3, 4, 5, 6], f"{label}: {_logged(got, 'loss')}"
    check_weights(tmp / label / "final", tmp / "accelerate" / "final", label)
    assert got["checkpoints"] == ["checkpoint-6"], f"{label}: save_total_limit=1 kept {got['checkpoints']}"


def test_a_foreign_or_bad_start_is_refused_in_one_line(runs: dict[str, Any]) -> None:
    """Four refusals, each before any training step, in one line naming the field or file and the
    fix: a checkpoint Accelerate wrote (no sharded state in it); a config whose grad_accum_steps
    disagrees with the Trainer's gradient_accumulation_steps (the Trainer accumulates: counting
    twice would halve every gradient); tensor parallelism (the Trainer's loss normalisation reads
    Accelerate's layout; its losses came out doubled); a script's own accelerate.Accelerator under
    `shardwise launch` (it would run Accelerate's engine and ignore the config)."""
    tmp = runs["tmp"]
    foreign = tmp / "accelerate" / "checkpoint-3"
    _, err = launch(tmp, "foreign", "strategy: zero3\n", "--resume_from_checkpoint", str(foreign),
                    expect_ok=False)
    check_refusal(err, rf"resume_from_checkpoint='{foreign}': no shardwise/ folder in it")
    _, err = launch(tmp, "twice", "strategy: zero3\ngrad_accum_steps: 4\n", expect_ok=False)
    check_refusal(err, r"grad_accum_steps=4 \(from .*twice.yaml or a DeepSpeed JSON\) and the Trainer's "
                       r"gradient_accumulation_steps=2 disagree")
    _, err = launch(tmp, "tp", "strategy: zero3\ntensor_parallel_size: 2\n", expect_ok=False)
    check_refusal(err, r"tensor_parallel_size=2 \(from .*tp.yaml\) under transformers' Trainer is not "
                       r"supported")
    check_own_accelerator_refused(tmp)


OWN = """from accelerate import Accelerator
import torch
acc = Accelerator(cpu=True)
model = acc.prepare(torch.nn.Linear(2, 2))
print("trained on Accelerate's", type(acc).__module__)
"""


def check_own_accelerator_refused(tmp: Path, env: dict[str, str] | None = None) -> None:
    script = tmp / "own_accelerator.py"
    script.write_text(OWN)
    cfg = tmp / "own.yaml"
    cfg.write_text("strategy: zero3\n")
    done = subprocess.run([sys.executable, "-m", "shardwise", "launch", "--num-processes", "2",
                           "--config", str(cfg), str(script)], env=_env() if env is None else env,
                          capture_output=True, text=True, timeout=300, check=False)
    check_refusal(done.stderr, r"this script builds accelerate\.Accelerator, which ignores the shardwise "
                               r"config it was launched with: change `from accelerate import Accelerator` to "
                               r"`from shardwise import Accelerator`")


def check_refusal(err: str, pattern: str) -> None:
    import re

    lines = [line for line in err.splitlines() if line.startswith("shardwise launch: rank 0 ")]
    assert lines, f"no failed worker reported:\n{err[-3000:]}"
    assert re.search(pattern, lines[0]), f"rank 0 ended otherwise: {lines[0]!r}"
    assert "Traceback" not in lines[0] and "Step" not in err.split(lines[0])[0][-2000:]


def test_lora_adapters_under_zero3_are_saved_as_adapters_peft_loads(runs: dict[str, Any]) -> None:
    """A peft LoRA model (q/v adapters) under the Trainer at zero3: Accelerate's numbers, each
    rank holding half the parameters, `save_model` writing adapters (adapter_config.json,
    adapter_model.safetensors; no base weights), which peft loads onto the base with the
    logits of Accelerate's adapters (1e-5)."""
    tmp, ref = runs["tmp"], runs["lora"]
    got, _ = launch(tmp, "lora_zero3", "strategy: zero3\n", "--lora")
    assert got is not None
    check_numbers(got, ref, "lora_zero3")
    check_held(got, ref, "lora_zero3", 0.5)
    check_adapters(tmp / "lora_zero3" / "final", tmp / "accelerate_lora" / "final")


def check_adapters(mine: Path, theirs: Path) -> None:
    from peft import PeftModel
    from transformers import set_seed

    files = sorted(p.name for p in mine.iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files, (
        f"no adapters saved: {files}")
    assert "model.safetensors" not in files, f"base weights written beside the adapters: {files}"
    logits = []
    for folder in (mine, theirs):
        set_seed(0)  # the script's base model: built from its config after set_seed(0)
        model = PeftModel.from_pretrained(_base(), folder).eval()
        with torch.no_grad():
            logits.append(model(input_ids=torch.arange(3, 19).reshape(1, 16)).logits)
    worst = (logits[0] - logits[1]).abs().max().item()
    assert worst <= WEIGHTS, f"peft-loaded adapters' logits differ from Accelerate's by {worst:.2e}"


def _base() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("route", ["install", "mixin"])
def test_the_code_route_puts_the_trainer_on_shardwise(runs: dict[str, Any], route: str) -> None:
    """Without `shardwise launch` (plain torchrun, as a notebook's own process would): one line,
    `shardwise.trainer.install(strategy="zero3")`, or the class `ShardwiseTrainer` (its settings
    from SHARDWISE_CONFIG), gives Accelerate's numbers with each rank holding half."""
    tmp, ref = runs["tmp"], runs["ref"]
    label = f"in_code_{route}"
    out = tmp / f"{label}.json"
    env = _env()
    if route == "mixin":
        (tmp / "mixin.yaml").write_text("strategy: zero3\n")
        env["SHARDWISE_CONFIG"] = str(tmp / "mixin.yaml")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2",
                           str(SCRIPT.with_name("in_code.py")), route, "--output_dir", str(tmp / label),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    check_numbers(got, ref, label)
    check_held(got, ref, label, 0.5)
    assert "runs on shardwise's Accelerator: strategy zero3" in done.stderr


def test_bf16_and_gradient_checkpointing_arguments_are_applied(runs: dict[str, Any]) -> None:
    """`TrainingArguments(bf16=True, gradient_checkpointing=True)` under zero3: the run says bf16
    and tracks Accelerate's bf16 run (BF16_REL, BF16_NORM_REL: the two cast differently, autocast
    against cast parameters, both with fp32 master weights)."""
    tmp = runs["tmp"]
    flags = ("--bf16", "--gradient_checkpointing")
    ref, _ = launch(tmp, "accelerate_bf16", None, *flags, reference=True)
    got, err = launch(tmp, "zero3_bf16", "strategy: zero3\n", *flags)
    assert ref is not None and got is not None
    assert "strategy zero3, bf16" in err
    check_numbers(got, ref, "zero3_bf16", rel=BF16_REL, norm_rel=BF16_NORM_REL)


def test_planted_trainer_faults_are_caught(runs: dict[str, Any]) -> None:
    """Each row's check fails on its planted regression, for its reason (one launch each):
    the Trainer left on Accelerate's Accelerator (the config ignored, every rank the whole model);
    the engine counting the Trainer's accumulation again (a DeepSpeed JSON's "auto"); a resume
    without the Trainer's scheduler; a script's own accelerate.Accelerator let run; adapters
    saved merged."""
    tmp, ref = runs["tmp"], runs["ref"]
    got, _ = launch(tmp, "planted_accelerate", "strategy: zero3\n",
                    env=fault_env("trainer_left_on_accelerate", _env()))
    assert got is not None
    caught(check_numbers, got, ref, "planted",
           must=r"the Trainer ran on accelerate\.accelerator\.Accelerator")
    caught(check_held, got, ref, "planted", 0.5, must=r"rank 0 held 107136 of 107136 parameter bytes")
    got, _ = launch(tmp, "planted_twice", None, "--deepspeed", str(tmp / "ds.json"),
                    env=fault_env("trainer_accumulates_twice", _env()))
    assert got is not None
    caught(check_numbers, got, ref, "planted", must=r"grad_norm at step 1: 0\.50")
    run_case(runs, "zero3")
    got, _ = launch(tmp, "planted_resume", "strategy: zero3\n", "--resume_from_checkpoint",
                    str(tmp / "zero3" / "checkpoint-3"), "--save_total_limit", "1",
                    env=fault_env("trainer_resume_without_scheduler", _env()))
    assert got is not None
    caught(check_resumed, got, ref, "planted", tmp, 2, must=r"learning_rate at step 4")
    caught(check_own_accelerator_refused, tmp, fault_env("trainer_own_accelerator_allowed", _env()),
           must=r"no failed worker reported")
    got, _ = launch(tmp, "planted_merged", "strategy: zero3\n", "--lora",
                    env=fault_env("trainer_adapters_merged", _env()))
    caught(check_adapters, tmp / "planted_merged" / "final", tmp / "accelerate_lora" / "final",
           must=r"no adapters saved: \[.*'model\.safetensors'")
