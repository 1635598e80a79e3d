"""A script in Accelerate's pattern whose settings come from the launcher alone (issue 44):
`Accelerator()` with no keyword about sharding, under `accelerate launch --config_file X.yaml`
or `shardwise launch --config X.yaml` (tests/test_accelerate_plugins.py). Trains the tiny Llama
of tests/workloads.py on 2 processes, clipping at 1.0, and writes the settings the run took, its
losses and clipped norms (and, on the main process, its final weights) to OUT.json / OUT.pt.

usage: launcher_settings.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import workloads as W

from shardwise import Accelerator

GLOBAL, STEPS = 4, 3


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(seed=W.SEED)
    cfg = accelerator.config
    model = W.build("llama")
    opt = W.make_optimizer(model)
    batch = GLOBAL // accelerator.num_processes
    loader = DataLoader(W.Tokens(GLOBAL * STEPS), batch_size=batch, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses, norms = [], []
    for ids in loader:
        loss = W.lm_loss(model, ids)
        accelerator.backward(loss)
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    state = accelerator.get_state_dict(model)
    keys = ("strategy", "backend", "offload", "precision", "grad_accum_steps", "activation_checkpointing")
    settings = {k: getattr(cfg, k) for k in keys}
    settings["wrap"] = list(cfg.blocks.wrap)
    accelerator.end_training()
    if accelerator.is_main_process:
        torch.save(state, out.with_suffix(".pt"))
        out.write_text(json.dumps({"settings": settings, "losses": losses, "norms": norms, "done": True}))


if __name__ == "__main__":
    main()
