"""A script written for Hugging Face Accelerate in the pattern of its by_feature/checkpointing.py:
save_state every N batches into step_<n> folders, and resume with load_state plus the script's
own skipping of the batches already seen (Accelerate's load_state restores weights, optimizer,
scheduler and RNG, not the DataLoader's position). Also: a gradient accumulation plugin, the
seedable sampler, gather_for_metrics of objects, on_local_main_process, local_main_process_first.

    python -m torch.distributed.run --nproc-per-node 2 checkpoint_resume.py --out run.json --cpu \\
        --output_dir ckpts --checkpointing_steps 5 [--resume_from_checkpoint ckpts/step_10]
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.GELU(),
                                  nn.Dropout(0.2), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--project_dir", default=None)
    ap.add_argument("--output_dir", default=".")
    ap.add_argument("--checkpointing_steps", type=int, default=5)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=None,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11),
    )
    set_seed(7)
    with accelerator.local_main_process_first():
        train, valid = make_data(180, 0), make_data(45, 1)
    train_dataloader = DataLoader(train, batch_size=6, shuffle=True)
    eval_dataloader = DataLoader(valid, batch_size=8)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=len(train_dataloader) * args.epochs // 2)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    @accelerator.on_local_main_process
    def note(text):
        print(text, flush=True)

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        path = os.path.basename(args.resume_from_checkpoint)
        resume_step = int(path.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        overall_step = resume_step
        resume_step -= starting_epoch * len(train_dataloader)
    record = {"losses": [], "lrs": [], "metrics": [], "names": []}
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for x, y in active_dataloader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            record["losses"].append([overall_step, accelerator.gather(loss.detach()[None]).tolist()])
            record["lrs"].append(lr_scheduler.get_last_lr()[0])
            if overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
        model.eval()
        correct, seen, names = 0, 0, []
        for x, y in eval_dataloader:
            with torch.no_grad():
                pred = model(x).argmax(dim=-1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += int((pred == y).sum())
            seen += len(y)
            names += accelerator.gather_for_metrics([f"sample-{int(v)}" for v in y.tolist()[:1]],
                                                    use_gather_object=True)
        record["metrics"].append({"epoch": epoch, "accuracy": correct / seen, "seen": seen})
        record["names"].append(names)
        note(f"epoch {epoch}: accuracy {correct / seen:.4f}")
    accelerator.end_training()
    record["done"] = True  # the harness checks it: the run got past end_training()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
