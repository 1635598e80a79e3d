"""A script that ends as many do: `wait_for_everyone()`, then the main process alone saves the
sharded model with its own `save_pretrained`, and no `end_training()`: the other process's next
call is the interpreter's exit, where it serves the main process's gather
(`shardwise.engine.lone`). Rank 0 also writes the weights every process gathered before the
barrier (`gathered.pt`), to compare the saved folder with."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import workloads as W

import shardwise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    model = W.build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = engine.prepare(model, opt)
    ids = W.Tokens(2 * engine.num_processes).data[2 * engine.process_index:2 * engine.process_index + 2]
    engine.backward(W.lm_loss(model, ids))
    opt.step()
    opt.zero_grad()
    gathered = engine.get_state_dict(model)
    engine.wait_for_everyone()
    if engine.is_main_process:
        torch.save(gathered, out / "gathered.pt")
        engine.unwrap_model(model).save_pretrained(out / "saved")


if __name__ == "__main__":
    main()
