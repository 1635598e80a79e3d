"""Scripts in the pattern of transformers' examples/pytorch/*/run_*_no_trainer.py, one per task
(`--task`): the model from a tiny config under `set_seed`, grouped weight decay, a linear warmup
schedule stepped per process, `accumulate`, evaluation through `gather_for_metrics` (or, as
run_ner and run_translation do, `pad_across_processes` + `gather` and a hand-cut last batch),
translation evaluated with `unwrap_model(model).generate(...)`, and the scripts' last lines:
`unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save)`
on every process.

    clm          GPT2LMHeadModel (tied head), perplexity
    mlm          BertForMaskedLM (tied embeddings and decoder), masked-token perplexity
    glue         BertForSequenceClassification, accuracy
    ner          BertForTokenClassification, token accuracy of padded, gathered predictions
    translation  T5ForConditionalGeneration (shared, tied embeddings), generate: token accuracy

Data is made in code (no tokenizer, no hub). Records losses, metrics, the state's text, and the
trained model's logits on a fixed probe (to compare with the saved folder, reloaded):
    python -m torch.distributed.run --nproc-per-node 2 no_trainer.py --task clm --cpu --out r.json \\
        --output_dir saved
"""

import argparse
import json
import logging
import math

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
    get_scheduler,
)

logger = get_logger(__name__)
VOCAB, SEQ, PAD = 96, 12, 0
NUM_TAGS = 5


def _bert(**extra):
    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **extra)


def build(task):
    if task == "clm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if task == "mlm":
        return BertForMaskedLM(_bert())
    if task == "glue":
        return BertForSequenceClassification(_bert(num_labels=2))
    if task == "ner":
        return BertForTokenClassification(_bert(num_labels=NUM_TAGS))
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, dropout_rate=0.0, decoder_start_token_id=PAD,
                                               pad_token_id=PAD, eos_token_id=1))


class Synthetic(Dataset):
    """Each task's examples from a fixed generator: learnable, so the metrics move."""

    def __init__(self, task, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.task = task
        self.ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
        if task in ("clm", "mlm"):  # counting sequences from a random start: learnable
            self.ids = (self.ids[:, :1] + torch.arange(SEQ)) % (VOCAB - 2) + 2
        if task == "mlm":  # 15% of positions masked (token 3), the rest ignored
            mask = torch.rand(n, SEQ, generator=g) < 0.15
            mask[:, 0] = True
            self.labels = torch.where(mask, self.ids, torch.full_like(self.ids, -100))
            self.ids = torch.where(mask, torch.full_like(self.ids, 3), self.ids)
        elif task == "glue":
            self.labels = (self.ids[:, 0] < self.ids[:, -1]).long()
        elif task == "ner":
            self.labels = self.ids % NUM_TAGS
        elif task == "translation":  # the target: the source reversed, then eos
            self.labels = torch.cat([self.ids[:, :5].flip(1), torch.ones(n, 1, dtype=torch.long)], dim=1)
        else:
            self.labels = self.ids.clone()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def evaluate(task, accelerator, model, eval_dataloader, batch_size):
    model.eval()
    losses, right, seen, samples_seen = [], 0, 0, 0
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            if task == "translation":
                generated = accelerator.unwrap_model(model).generate(
                    batch["input_ids"], attention_mask=batch["attention_mask"], max_length=8, num_beams=1)
                generated = accelerator.pad_across_processes(generated, dim=1, pad_index=PAD)
                labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=PAD)
                generated, labels = accelerator.gather(generated), accelerator.gather(labels)
                if step == len(eval_dataloader) - 1:  # the last batch has duplicates: cut by hand
                    generated = generated[: len(eval_dataloader.dataset) - samples_seen]
                    labels = labels[: len(eval_dataloader.dataset) - samples_seen]
                else:
                    samples_seen += len(labels)
                width = min(generated.shape[1] - 1, labels.shape[1])  # (generated[:, 0]: the start token)
                right += int((generated[:, 1:1 + width] == labels[:, :width]).sum())
                seen += labels.numel()
                continue
            outputs = model(**batch)
        if task in ("clm", "mlm"):
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(batch_size)))
        elif task == "glue":
            predictions, labels = accelerator.gather_for_metrics(
                (outputs.logits.argmax(dim=-1), batch["labels"]))
            right += int((predictions == labels).sum())
            seen += len(labels)
        else:  # ner: padded and gathered, the last batch cut by hand (run_ner_no_trainer)
            predictions = outputs.logits.argmax(dim=-1)
            predictions = accelerator.pad_across_processes(predictions, dim=1, pad_index=-100)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            predictions, labels = accelerator.gather((predictions, labels))
            if step == len(eval_dataloader) - 1:
                predictions = predictions[: len(eval_dataloader.dataset) - samples_seen]
                labels = labels[: len(eval_dataloader.dataset) - samples_seen]
            else:
                samples_seen += labels.shape[0]
            right += int((predictions == labels).sum())
            seen += labels.numel()
    if losses:
        loss = torch.cat(losses).mean().item()
        return {"eval_loss": loss, "perplexity": math.exp(loss), "n": len(torch.cat(losses))}
    return {"accuracy": right / seen, "n": seen}


def probe(task):
    """A fixed input for the trained model's logits, here and after reloading the saved folder."""
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "translation":
        batch["decoder_input_ids"] = torch.randint(2, VOCAB, (2, 4), generator=g)
    return batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True, choices=["clm", "mlm", "glue", "ner", "translation"])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--project_dir", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=args.cpu)
    logging.basicConfig(level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(42)
    model = build(args.task)
    with accelerator.main_process_first():
        train_set, eval_set = Synthetic(args.task, 48, 0), Synthetic(args.task, 13, 1)  # 13: a padded batch
    batch_size = 3
    train_dataloader = DataLoader(train_set, shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(eval_set, batch_size=batch_size)

    no_decay = ["bias", "LayerNorm.weight", "layer_norm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=5e-3)
    max_train_steps = args.epochs * math.ceil(len(train_dataloader) / 2)
    lr_scheduler = get_scheduler(name="linear", optimizer=optimizer,
                                 num_warmup_steps=1 * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    record = {"state": str(accelerator.state), "losses": [], "metrics": [], "lrs": []}
    completed_steps = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            record["losses"].append(loss.item())
            if accelerator.sync_gradients:
                completed_steps += 1
                record["lrs"].append(lr_scheduler.get_last_lr()[0])
        metrics = evaluate(args.task, accelerator, model, eval_dataloader, batch_size)
        logger.info(f"epoch {epoch}: {metrics}")
        record["metrics"].append(metrics)

    # the trained model's logits on the probe, every process (a sharded forward needs them all)
    model.eval()
    with torch.no_grad():
        record["probe"] = model(**probe(args.task)).logits.tolist()

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    record["done"] = True  # the harness checks it: the run got past end_training()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
