"""A training script written for Hugging Face Accelerate (its nlp_example / by_feature pattern:
gradient accumulation, a warmup schedule, clipping, gather_for_metrics, triggers, automatic
checkpoint naming, a tracker). The test runs it unchanged under Accelerate, and with only the
`from accelerate import Accelerator` line changed to `from shardwise import Accelerator`.

Data and model are small local stand-ins (a tiny BERT from its config, a synthetic pair task):
    python -m torch.distributed.run --nproc-per-node 2 train_classifier.py --out run.json --cpu
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

VOCAB, SEQ = 64, 16


class Pairs(Dataset):
    """Label 1 when the first token is smaller than the last, with a fixed generator."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = (self.ids[:, 0] < self.ids[:, -1]).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--project_dir", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=None,
        gradient_accumulation_steps=2,
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    set_seed(42)
    with accelerator.main_process_first():
        train_set, eval_set = Pairs(100, 0), Pairs(37, 1)  # 37: the last eval batch is padded
    train_dataloader = DataLoader(train_set, batch_size=4, shuffle=True)
    eval_dataloader = DataLoader(eval_set, batch_size=4)

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2)
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=4,
                                                   num_training_steps=len(train_dataloader) * args.epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accelerator.init_trackers("classifier", config={"lr": 2e-3})

    @accelerator.on_main_process
    def say(text):
        print(text, flush=True)

    record = {"losses": [], "lrs": [], "metrics": [],
              "distributed_type": str(accelerator.distributed_type.value),
              "mixed_precision": accelerator.mixed_precision, "num_processes": accelerator.num_processes,
              "multi": accelerator.distributed_type != DistributedType.NO,
              "steps": accelerator.gradient_accumulation_steps}
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            record["losses"].append(accelerator.reduce(loss.detach(), "mean").item())
            record["lrs"].append(lr_scheduler.get_last_lr()[0])
            if loss.item() > 100:  # never true here: the trigger must stay down
                accelerator.set_trigger()
        if accelerator.check_trigger():
            break
        model.eval()
        predictions, references = [], []
        for batch in eval_dataloader:
            with torch.no_grad():
                logits = model(**batch).logits
            preds, refs = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["labels"]))
            predictions.append(preds)
            references.append(refs)
        preds, refs = torch.cat(predictions), torch.cat(references)
        tp = int(((preds == 1) & (refs == 1)).sum())
        f1 = 2 * tp / max(1, int((preds == 1).sum()) + int((refs == 1).sum()))
        metric = {"epoch": epoch, "n": len(preds), "accuracy": float((preds == refs).float().mean()),
                  "f1": f1}
        record["metrics"].append(metric)
        accelerator.log(metric, step=epoch)
        say(f"epoch {epoch}: {metric}")
        accelerator.save_state()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    record["done"] = True  # the harness checks it: the run got past end_training()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
