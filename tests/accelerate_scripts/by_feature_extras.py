"""A script written for Hugging Face Accelerate in the patterns of its by_feature examples
`tracking` (a TensorBoard tracker under project_dir), `profiler` (ProfileKwargs with
output_trace_dir), `schedule_free` (the optimizer's own train()/eval()) and
`gradient_accumulation_for_autoregressive_models` (model.no_sync on all but the last micro-batch),
with `accelerate.logging.get_logger` as every example uses it.

    python -m torch.distributed.run --nproc-per-node 2 by_feature_extras.py --out run.json --cpu \\
        --project_dir run
"""

import argparse
import contextlib
import json
import logging
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProfileKwargs, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

logger = get_logger(__name__, log_level="INFO")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class TrainEvalSGD(torch.optim.SGD):
    """The shape of schedule_free's optimizers: eval() moves the weights to another point, train()
    back (here: a half, and back)."""

    @torch.no_grad()
    def eval(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.5)

    @torch.no_grad()
    def train(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(2.0)


def weight_sum(accelerator, model):
    state = accelerator.get_state_dict(model)  # every process takes part; the main one gets it all
    return sum(float(v.double().abs().sum()) for v in state.values()) if accelerator.is_main_process else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--project_dir", required=True)
    args = ap.parse_args()

    lines = Lines()
    logger.logger.addHandler(lines)
    logger.logger.propagate = False
    traces = os.path.join(args.project_dir, "traces")
    accelerator = Accelerator(cpu=args.cpu, log_with="tensorboard", project_dir=args.project_dir,
                              kwargs_handlers=[ProfileKwargs(output_trace_dir=traces)])
    logger.info("main only")
    logger.info(f"everyone {accelerator.process_index}", main_process_only=False)
    set_seed(3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    data = TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = TrainEvalSGD(model.parameters(), lr=0.2)
    loader = DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.init_trackers("extras")
    record = {"losses": [], "active": []}
    with accelerator.profile():
        batches = iter(loader)
        for update in range(len(loader) // 2):
            samples = [next(batches), next(batches)]
            for i, (xb, yb) in enumerate(samples):
                # no communication on all but the last micro-batch, as the autoregressive example
                ctx = (model.no_sync if i < len(samples) - 1 and accelerator.num_processes > 1
                       else contextlib.nullcontext)
                with ctx():
                    loss = nn.functional.cross_entropy(model(xb), yb)
                    accelerator.backward(loss)
                record["active"].append(accelerator.gradient_state.active_dataloader is not None)
                record["losses"].append(accelerator.reduce(loss.detach(), "mean").item())
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"epoch": update}, step=update)
        for _ in batches:  # the pass runs to its end
            pass
    record["active_after"] = accelerator.gradient_state.active_dataloader is not None
    optimizer.eval()
    record["eval_weights"] = weight_sum(accelerator, model)
    optimizer.train()
    record["train_weights"] = weight_sum(accelerator, model)
    with open(os.path.join(args.project_dir, f"log_{accelerator.process_index}.json"), "w") as f:
        json.dump(lines.lines, f)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record["traces"] = sorted(os.listdir(traces))
        record["event_dirs"] = sorted(os.path.relpath(root, args.project_dir) for root, _, files in
                                      os.walk(args.project_dir) if any(".tfevents." in f for f in files))
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(os.path.join(args.project_dir, "extras"))
        events.Reload()
        record["epoch"] = [(e.step, e.value) for e in events.Scalars("epoch")]
        with open(args.out, "w") as f:
            json.dump(record, f)
    accelerator.end_training()  # Accelerate's also ends the process group: last
    record["done"] = True  # the harness checks it: the run got past end_training()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
