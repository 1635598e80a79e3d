"""A causal-LM fine-tuning script on transformers' `Trainer`, as users write them (the shape of
transformers' examples/pytorch/language-modeling/run_clm.py): a tiny Llama built from its config,
token data made in code, gradient accumulation, clipping, a linear schedule with warmup, periodic
checkpoints, evaluation, and `save_model`. Nothing in it names shardwise: the tests run it
unchanged under Accelerate (`torchrun`, ACCELERATE_USE_CPU=1) and under `shardwise launch --config`.

It writes `--out` (JSON, main process): the Trainer's log history, the eval metrics, the final
predictions' loss, which Accelerator class ran it, and each rank's trainable parameter bytes
measured during training (a callback)."""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences with a few padded tails (labels -100 there), made from a seed."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, seq), generator=g)
        self.lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i].clone()
        mask = torch.ones_like(ids)
        mask[self.lengths[i]:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Measure(TrainerCallback):
    """Each rank's bytes of parameters it holds, read at every step's end (what the sharding leaves
    on the rank while the Trainer trains)."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        total = 0
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)  # DeepSpeed's own
            total += local.numel() * local.element_size()
        self.held.append(total)


def accuracy(predicted) -> dict[str, float]:
    """Next-token accuracy over the labelled positions (the predictions: argmax ids)."""
    ids, labels = predicted.predictions[:, :-1], predicted.label_ids[:, 1:]
    kept = labels != -100
    return {"accuracy": float((ids[kept] == labels[kept]).mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_steps", type=int, default=6)
    ap.add_argument("--save_steps", type=int, default=3)
    ap.add_argument("--save_total_limit", type=int, default=None)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--load_best_model_at_end", action="store_true")
    ap.add_argument("--greater_is_better", action="store_true")
    ap.add_argument("--gradient_accumulation_steps", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--fsdp", default="")
    ap.add_argument("--fsdp_config", default=None)
    ap.add_argument("--deepspeed", default=None)
    ap.add_argument("--report_to", default="none")
    args = ap.parse_args()

    set_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=3e-3,
        weight_decay=0.01,
        max_grad_norm=0.5,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_steps=args.max_steps,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        load_best_model_at_end=args.load_best_model_at_end,
        metric_for_best_model="eval_loss" if args.load_best_model_at_end else None,
        greater_is_better=args.greater_is_better if args.load_best_model_at_end else None,
        bf16=args.bf16,
        fsdp=args.fsdp,
        fsdp_config=args.fsdp_config,
        deepspeed=args.deepspeed,
        **({"gradient_checkpointing": True} if args.gradient_checkpointing else {}),
        report_to=args.report_to,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    measure = Measure()
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(64, 16, 128, 1),
                      eval_dataset=Tokens(16, 16, 128, 2), callbacks=[measure], compute_metrics=accuracy,
                      preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    predicted = trainer.predict(Tokens(8, 16, 128, 3))
    trainer.save_model(os.path.join(args.output_dir, "final"))
    rank = int(os.environ.get("RANK", "0"))
    held = {rank: measure.held}
    if torch.distributed.is_initialized():
        every: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, held)
        held = {k: v for d in every for k, v in d.items()}
    if trainer.is_world_process_zero():
        with open(args.out, "w") as f:
            json.dump({"log_history": trainer.state.log_history, "eval": metrics,
                       "predict_loss": predicted.metrics["test_loss"],
                       "predict_accuracy": predicted.metrics["test_accuracy"],
                       "accelerator": type(trainer.accelerator).__module__ + "." +
                       type(trainer.accelerator).__name__,
                       "held": held, "global_step": trainer.state.global_step,
                       "best": trainer.state.best_model_checkpoint,
                       "checkpoints": sorted(d for d in os.listdir(args.output_dir)
                                             if d.startswith("checkpoint-"))}, f)


if __name__ == "__main__":
    main()
