"""TRL's GRPO script (trl/scripts/grpo.py), with what it loads from the hub made in code
(tiny_lm.py): a tiny Qwen2 and a word-level tokenizer, prompts with their answers, and a reward
function in code. Generation is the model's own `generate` (`use_vllm=False`, TRL's default).
Nothing in it names shardwise: the tests run it unchanged under Accelerate (`torchrun`,
ACCELERATE_USE_CPU=1) and under `shardwise launch --config`.

    python grpo.py --output_dir OUT --out results.json [any GRPOConfig flag]

It writes `--out` (JSON, main process): the Trainer's log history (every step's loss, grad_norm,
reward, reward_std, completion lengths, entropy, clip ratios; the evaluations), which Accelerator
class ran it, and each rank's bytes of parameters held at each step's end."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import tiny_lm
import transformers
from datasets import Dataset
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer, TrlParser

# 4 prompts x 4 completions of up to 8 tokens per optimizer step (2 processes x 4 x 2 micro-steps);
# fp32 (TRL's default bf16 autocast rounds differently from a bf16 sharded run) and TRL's default
# gradient checkpointing (turned off around generation by TRL). The evaluation's global batch (2 x
# 2) divides the number of evaluation prompts: Accelerate cuts the last gathered batch to
# len(dataset) % global batch items, though TRL's sampler serves each prompt num_generations times
# (so with 4 prompts and batches of 8, Accelerate's eval_loss would leave out 4 of its 16 items).
DEFAULTS = {
    "use_cpu": True, "bf16": False, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 2,
    "gradient_accumulation_steps": 2, "num_generations": 4, "max_completion_length": 8,
    "learning_rate": 3e-3, "max_grad_norm": 0.5, "lr_scheduler_type": "linear", "warmup_steps": 0,
    "max_steps": 4, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "no",
    "report_to": [], "seed": 0, "data_seed": 0, "dataloader_num_workers": 0, "disable_tqdm": True,
}


@dataclass
class ScriptArguments:
    out: str = field(metadata={"help": "where the main process writes its results (JSON)"})
    num_train: int = field(default=32, metadata={"help": "training prompts"})
    num_eval: int = field(default=4, metadata={"help": "evaluation prompts"})


def dataset(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "answer": []}
    for _ in range(n):
        question, answer = tiny_lm.sums(rng)
        rows["prompt"].append(question)
        rows["answer"].append(answer.split(" ")[0])
    return Dataset.from_dict(rows)


def answer_reward(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """1 for the right number as the completion's first word, plus 0.1 per number word in it."""
    rewards = []
    for completion, right in zip(completions, answer, strict=True):
        said = completion.split()
        rewards.append(float(bool(said) and said[0] == right) + 0.1 * sum(w in tiny_lm.NUMBERS for w in said))
    return rewards


def main(script_args: ScriptArguments, training_args: GRPOConfig) -> None:
    tokenizer = tiny_lm.tokenizer()
    model = tiny_lm.model(tokenizer)
    measure = tiny_lm.Measure()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[answer_reward],
        args=training_args,
        train_dataset=dataset(script_args.num_train, 1),
        eval_dataset=dataset(script_args.num_eval, 2) if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        callbacks=[measure],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    held = tiny_lm.per_rank(measure.held)
    tiny_lm.write(trainer, script_args.out, held=held)
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig))
    parser.set_defaults_with_config(**DEFAULTS)
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)
