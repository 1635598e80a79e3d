"""TRL's DPO script (trl/scripts/dpo.py), with what it loads from the hub made in code
(tiny_lm.py): a tiny Qwen2 policy, a frozen reference model built separately from the same seed
(`ref_model=`), a word-level tokenizer, and a preference dataset (prompt, chosen, rejected).
Nothing in it names shardwise: the tests run it unchanged under Accelerate (`torchrun`,
ACCELERATE_USE_CPU=1) and under `shardwise launch --config`.

    python dpo.py --output_dir OUT --out results.json [any DPOConfig flag]

It writes `--out` (JSON, main process): the Trainer's log history (every step's loss, grad_norm,
rewards/*, logps/*, logits/*; the evaluations), which Accelerator class ran it, each rank's bytes
of parameters held at each step's end by the policy and by the reference model, and both models'
weights' checksums before and after training (the reference's must not change)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import tiny_lm
import transformers
from datasets import Dataset
from packaging.version import Version
from trl import DPOConfig, DPOTrainer, TrlParser

# what the tests run: gradient accumulation, clipping, a log line every step, evaluations; fp32
# (TRL's default bf16 autocast rounds differently from a bf16 sharded run) and TRL's default
# gradient checkpointing
DEFAULTS = {
    "use_cpu": True, "bf16": False, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4,
    "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "max_grad_norm": 0.5,
    "lr_scheduler_type": "linear", "warmup_steps": 0, "max_steps": 6, "logging_steps": 1,
    "eval_strategy": "steps", "eval_steps": 3, "save_strategy": "no", "beta": 0.1, "max_length": 48,
    "report_to": [], "seed": 0, "data_seed": 0, "dataloader_num_workers": 0, "disable_tqdm": True,
}


@dataclass
class ScriptArguments:
    out: str = field(metadata={"help": "where the main process writes its results (JSON)"})
    num_train: int = field(default=64, metadata={"help": "training examples"})
    num_eval: int = field(default=16, metadata={"help": "evaluation examples"})


def dataset(n: int, seed: int) -> Dataset:
    """A question, its right answer (chosen) and a wrong one (rejected)."""
    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        question, answer = tiny_lm.sums(rng)
        right = answer.split(" ")[0]
        wrong = rng.choice([w for w in tiny_lm.NUMBERS if w != right])
        rows["prompt"].append(question)
        rows["chosen"].append(answer)
        rows["rejected"].append(answer.replace(right, wrong, 1))
    return Dataset.from_dict(rows)


def main(script_args: ScriptArguments, training_args: DPOConfig) -> None:
    tokenizer = tiny_lm.tokenizer()
    model = tiny_lm.model(tokenizer, seed=0)
    ref_model = tiny_lm.model(tokenizer, seed=0)  # the same weights, another object
    before = {"model": tiny_lm.checksum(model), "ref_model": tiny_lm.checksum(ref_model)}
    trainer: DPOTrainer | None = None
    measure = tiny_lm.Measure(ref_model=lambda: trainer.ref_model)
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=training_args,
        train_dataset=dataset(script_args.num_train, 1),
        eval_dataset=dataset(script_args.num_eval, 2) if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        callbacks=[measure],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    metrics = trainer.evaluate()
    after = {"model": tiny_lm.checksum(trainer.model), "ref_model": tiny_lm.checksum(trainer.ref_model)}
    trainer.save_model(training_args.output_dir)
    held = tiny_lm.per_rank(measure.held)
    tiny_lm.write(trainer, script_args.out, eval=metrics, held=held, before=before, after=after)
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, DPOConfig))
    parser.set_defaults_with_config(**DEFAULTS)
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)
