"""A script written for Hugging Face Accelerate in the patterns of its by_feature examples `memory`
(find_executable_batch_size: free_memory, then prepare again), `early_stopping` (a pass left with
`break`), `cross_validation` (predictions gathered after the loop), `checkpointing` (save_state,
then load_state plus skip_first_batches) and a GradientAccumulationPlugin with sync_each_batch.

    python -m torch.distributed.run --nproc-per-node 2 drop_in_rules.py --out run.json --cpu \\
        --output_dir ckpts [--resume_from_checkpoint ckpts/e1_b5_s8]
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, find_executable_batch_size, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] * x[:, 1] + x[:, 2] > 0).long()
    return TensorDataset(x, y)


def grad_size(model):
    """Sum of |gradient| over the whole model (the full gradient, if it is sharded)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        g = p.grad
        if g is not None:
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            total += g.double().abs().sum()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--project_dir", default=None)
    ap.add_argument("--output_dir", default=".")
    ap.add_argument("--resume_from_checkpoint", default=None)
    args = ap.parse_args()

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_plugin=plugin)
    set_seed(5)
    train, valid = make_data(100, 0), make_data(45, 1)
    record = {"tried": [], "types": [], "losses": [], "grads": [], "end_after_loop": [], "gathered": [],
              "accuracy": []}

    @find_executable_batch_size(starting_batch_size=9)
    def inner_training_loop(batch_size):
        accelerator.free_memory()
        record["tried"].append(batch_size)
        model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Dropout(0.25), nn.Linear(24, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_dl = DataLoader(train, batch_size=batch_size, shuffle=True)
        eval_dl = DataLoader(valid, batch_size=8)
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        record["types"].append(str(accelerator.distributed_type).split(".")[-1])
        if batch_size > 8:  # as Accelerate's own memory tests: the first size "does not fit"
            raise RuntimeError("CUDA out of memory. (simulated)")
        overall, start_epoch, skip = 0, 0, 0
        if args.resume_from_checkpoint:
            accelerator.load_state(args.resume_from_checkpoint)
            e, b, s = os.path.basename(args.resume_from_checkpoint).split("_")
            start_epoch, skip, overall = int(e[1:]), int(b[1:]), int(s[1:])
        for epoch in range(start_epoch, 3):
            model.train()
            loader = (accelerator.skip_first_batches(train_dl, skip) if skip and epoch == start_epoch
                      else train_dl)
            for step, (x, y) in enumerate(loader, start=skip if epoch == start_epoch else 0):
                with accelerator.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    if not accelerator.sync_gradients:  # sync_each_batch: already the same everywhere
                        record["grads"].append(accelerator.gather(grad_size(model)[None].float()).tolist())
                    optimizer.step()
                    optimizer.zero_grad()
                overall += 1
                record["losses"].append([overall, accelerator.gather(loss.detach()[None]).tolist()])
                if epoch == 1 and step == 4 and not args.resume_from_checkpoint:
                    accelerator.save_state(os.path.join(args.output_dir, f"e{epoch}_b{step + 1}_s{overall}"))
                if epoch == 0 and step == 2:  # early stopping: leave the pass
                    break
            record["end_after_loop"].append(accelerator.gradient_state.end_of_dataloader)
            model.eval()
            preds, labels = [], []
            for x, y in eval_dl:
                with torch.no_grad():
                    preds.append(model(x).argmax(dim=-1))
                labels.append(y)
            # cross_validation's pattern: the fold's predictions gathered after the loop
            pred, ref = accelerator.gather_for_metrics((torch.cat(preds), torch.cat(labels)))
            record["gathered"].append(len(pred))
            record["accuracy"].append(float((pred == ref).float().mean()))

    inner_training_loop()
    accelerator.end_training()
    record["done"] = True  # the harness checks it: the run got past end_training()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
