"""A training run written to survive: two lines make it resume and checkpoint by itself.

    engine.load_state()                   # the newest complete checkpoint, or None on a fresh start
    checkpoint_every_steps: 2             # in the config: saves at step boundaries, no line in the loop

tests/test_resilience.py runs it under `shardwise launch` with faults injected through the
environment (SHARDWISE_TEST_FAULT), and in-process for the uninterrupted reference. Process 0
appends one JSON line per optimizer step (step, loss, attempt) to <folder>/losses.jsonl and, at
the end, the gathered weights to <folder>/final.pt.
  kill:STEP:RANK   on the first attempt, RANK SIGKILLs itself after optimizer step STEP
  hang:STEP:RANK   RANK sleeps forever inside optimizer step STEP (before its backward)
  slow:SECONDS     every step sleeps (so a test can send a signal at a chosen step)
  raise:STEP:RANK  RANK raises a ValueError inside optimizer step STEP
  full:STEP:RANK   RANK's files may not grow past 1 kB from optimizer step STEP on (a file-size limit,
                   the kernel's EFBIG, as a full disk): the checkpoint saved after step STEP fails
  stuck:STEP       every rank, at optimizer step STEP, waits in a collective that never completes
                   (each on a group of its own making: the main thread inside gloo, where Python
                   runs no signal handler), after writing <folder>/stuck.<rank>
  device:STEP      every rank, at optimizer step STEP, blocks as a process on a GPU whose collective
                   hung: its main thread waits for the device (a sync that never returns), in no
                   collective, where no timeout reaches it (here a sleep), after writing
                   <folder>/device.<rank>
  lostsave:STEP:RANK  on the first attempt, RANK SIGKILLs itself in the middle of saving the
                   checkpoint of step STEP (every process's tensors written, the checkpoint not
                   committed): a node lost mid-write
The model is the tiny GPT (tests/workloads.py "tiny"); with tensor_parallel_size > 1 in the
config file, the tiny Llama ("llama", which has a tensor-parallel plan). Each step's global batch
is 4 samples at any layout (split over the data-parallel ranks).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import workloads as W

STEPS = 8
SAMPLES = 48  # 2 epochs of 24 at a global batch of 4: resumes cross an epoch


def _fault() -> tuple[str, float, int]:
    spec = os.environ.get("SHARDWISE_TEST_FAULT", "")
    if not spec:
        return "", 0.0, -1
    kind, *rest = spec.split(":")
    return kind, float(rest[0]), int(rest[1]) if len(rest) > 1 else -1


def train(folder: str, steps: int = STEPS) -> dict[str, Any]:
    import shardwise

    out = Path(folder)
    engine = shardwise.Engine()  # strategy, checkpoint policy, timeouts: all from the config file
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kind, at, who = _fault()
    tp = engine.config.parallelism.tp
    model = W.build("llama" if tp > 1 else "tiny")
    opt = W.make_optimizer(model)
    loader = DataLoader(
        W.Tokens(SAMPLES // 2),
        batch_size=4 // (engine.num_processes // tp) // engine.config.training.grad_accum_steps,
        shuffle=True,
    )
    model, opt, loader = engine.prepare(model, opt, loader)
    if kind == "lostsave" and attempt == 0 and engine.process_index == who:
        _die_in_save(engine, int(at))
    apart: Any = None
    if kind == "stuck":  # two groups of the same ranks: each rank waits on its own, never met
        import torch.distributed as dist

        apart = [dist.new_group(list(range(engine.num_processes))) for _ in range(2)]
    resumed = engine.load_state()
    if engine.is_main_process:
        print(f"attempt {attempt}: starting at step {resumed or 0}", flush=True)
    while engine.step < steps:
        for ids in loader:
            with engine.accumulate(model):
                _in_step(kind, at, who, engine, out, apart)
                loss = W.lm_loss(model, ids)
                engine.backward(loss)
                opt.step()
                opt.zero_grad()
            value = engine.reduce(loss.detach(), "mean").item()
            if engine.sync_gradients and engine.is_main_process:
                with open(out / "losses.jsonl", "a") as f:
                    f.write(json.dumps({"step": engine.step, "loss": value, "attempt": attempt}) + "\n")
            if kind == "kill" and attempt == 0 and engine.step == at and engine.process_index == who:
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.step >= steps:
                break
    state = engine.get_state_dict(model)
    if engine.is_main_process:
        torch.save(state, out / "final.pt")
    engine.end_training()
    return {"state": state}


def _in_step(kind: str, at: float, who: int, engine: Any, out: Path, apart: Any) -> None:
    """The fault of the micro-step about to run (see the module docstring), if it is due."""
    step = engine.step + 1  # the optimizer step this micro-step belongs to
    mine = engine.process_index == who
    if kind == "hang" and step == at and mine:
        time.sleep(10**6)
    if kind == "device" and step == at:
        (out / f"device.{engine.process_index}").write_text("")
        time.sleep(10**6)
    if kind == "slow":
        time.sleep(at)
    if kind == "stuck" and step == at:
        import torch.distributed as dist

        (out / f"stuck.{engine.process_index}").write_text("")
        dist.all_reduce(torch.ones(1), group=apart[engine.process_index % 2])
    if kind == "raise" and step == at and mine:
        raise ValueError(f"bad batch in step {step}")
    if kind == "full" and step == at and mine:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))


def _die_in_save(engine: Any, step: int) -> None:
    """SIGKILL this process once the tensors of step `step`'s checkpoint are written, before it
    is committed (meta.json, the rename)."""
    import shardwise.checkpoint.sharded as ck

    real_save = ck.dcp.save

    def save_then_die(*args: Any, **kwargs: Any) -> Any:
        out = real_save(*args, **kwargs)
        if engine.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    ck.dcp.save = save_then_die


def read_losses(folder: Path) -> dict[int, float]:
    """The newest loss recorded for each step (a restarted run recomputes the lost ones)."""
    losses: dict[int, float] = {}
    for line in (folder / "losses.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]
    return dict(sorted(losses.items()))


if __name__ == "__main__":
    train(sys.argv[1])
