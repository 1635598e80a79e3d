"""The main process's calls alone after `wait_for_everyone()`, served by the others
(`shardwise.engine.lone`), on a zero3 `Engine` at 2 processes, against one plain process.

One run makes, in order:
1. 2 training steps, then `wait_for_everyone()`; the main process alone runs two no-grad
   forwards while the other process is already at a `gather` (a collective it makes with the
   main process next): served, the outputs are the plain model's at that point;
2. 2 more training steps (the losses stay the plain run's: serving changed no weight, no RNG);
3. `wait_for_everyone()`, then a no-grad forward on every process (an evaluation): together,
   nothing served;
4. `wait_for_everyone()`, then the main process alone sets its EMA-like copy: a diffusers
   `EMAModel` built before `prepare` (adopted at its first step), `store`/`copy_to`, a forward,
   `restore`, while the other process is at `get_state_dict`: the forward gives the plain EMA's
   output (the other process replayed the copy into its shard), and the gathered weights after
   `restore` are the trained ones, not the EMA's.
5. (a launched script) the main process's `save_pretrained` alone after `wait_for_everyone()`, at
   the end of a script that never calls `end_training()`: the other process serves it at its
   interpreter's exit.
6. (the Accelerator, zero3 on each backend: FSDP2 and DeepSpeed ZeRO-3) a transformers GPT-2:
   one training step, `wait_for_everyone()`, then the main process alone runs a sampled
   `generate` (seeded) and a greedy one, and a no-grad forward, while the other process is at a
   `gather`: served (the other runs each generate from the main process's random state, its own
   kept), the tokens are the plain model's, token for token, and the next training step and the
   weights are the plain run's; then a lone `generate` with no barrier before it, while the
   other process waits at the next barrier: refused in one line within seconds, not hung.
A lone forward with no barrier before it stays refused in one line (`test_accelerate_diffusers`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from planted import caught, planted
from spawn import run_command, spawn

STEPS = 4
SCRIPTS = Path(__file__).parent / "scripts"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g) for _ in range(2 * STEPS + 3)]


def _served_run() -> dict[str, Any]:
    from diffusers.training_utils import EMAModel

    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = _model()
    ema = EMAModel(model.parameters(), decay=0.5)  # diffusers' order: before prepare, never passed to it
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = engine.prepare(model, opt)
    data, rank, main = _data(), engine.process_index, engine.is_main_process
    out: dict[str, Any] = {"losses": []}

    def train(i: int) -> None:
        loss = model(data[2 * i + rank]).pow(2).mean()
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        ema.step(model.parameters())
        out["losses"].append(engine.reduce(loss.detach(), "mean").item())

    for i in range(2):
        train(i)
    engine.wait_for_everyone()
    if main:
        with torch.no_grad():
            out["lone"] = [model(data[-1]).clone() for _ in range(2)]
    out["gathered"] = engine.gather(torch.tensor([rank])).tolist()
    for i in range(2, STEPS):
        train(i)
    engine.wait_for_everyone()
    with torch.no_grad():
        out["together"] = model(data[-2]).clone()
    engine.wait_for_everyone()
    if main:
        ema.store(model.parameters())
        ema.copy_to(model.parameters())
        with torch.no_grad():
            out["lone_ema"] = model(data[-3]).clone()
        ema.restore(model.parameters())
    out["weights"] = engine.get_state_dict(model)
    return out


def _plain() -> dict[str, Any]:
    """One process: each step's loss is the mean over both processes' batches."""
    from diffusers.training_utils import EMAModel

    model = _model()
    ema = EMAModel(model.parameters(), decay=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = _data()
    out: dict[str, Any] = {"losses": []}
    for i in range(STEPS):
        loss = (model(data[2 * i]).pow(2).mean() + model(data[2 * i + 1]).pow(2).mean()) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        ema.step(model.parameters())
        out["losses"].append(loss.item())
        with torch.no_grad():
            if i == 1:
                out["lone"] = model(data[-1])
            if i == STEPS - 1:
                out["together"] = model(data[-2])
                ema.store(model.parameters())
                ema.copy_to(model.parameters())
                out["lone_ema"] = model(data[-3])
                ema.restore(model.parameters())
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def check_served(runs: list[dict[str, Any]], plain: dict[str, Any]) -> None:
    main = runs[0]
    for a, b in zip(main["losses"], plain["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (main["losses"], plain["losses"])
    assert [torch.allclose(x, plain["lone"], rtol=1e-5, atol=1e-6) for x in main["lone"]] == [True, True]
    assert main["gathered"] == runs[1]["gathered"] == [0, 1]
    for run in runs:
        torch.testing.assert_close(run["together"], plain["together"], rtol=1e-5, atol=1e-6)
    # the EMA copied into the main process's shard alone was copied into the other's too, and restored
    torch.testing.assert_close(main["lone_ema"], plain["lone_ema"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain["lone_ema"], plain["together"], atol=1e-3)  # (the EMA is not the model)
    assert main["weights"].keys() == plain["weights"].keys()
    for name, want in plain["weights"].items():  # after restore: the trained weights on every shard
        worst = (main["weights"][name] - want).abs().max().item()
        assert worst <= 2e-5, f"{name}: {worst:.2e} from the plain run's after restore (a shard kept the EMA)"


def test_lone_forwards_after_a_barrier_are_served() -> None:
    pytest.importorskip("diffusers")
    check_served(spawn(_served_run, 2, timeout=300), _plain())


def test_planted_lone_done_drops_journal_is_caught() -> None:
    """`lone_done_drops_journal`: the service ends without the main process's last EMA call (its
    `restore`): the other process's shard keeps the EMA weights, and the gathered model is half EMA."""
    pytest.importorskip("diffusers")
    caught(check_served, spawn(planted(_served_run, "lone_done_drops_journal"), 2, timeout=300), _plain(),
           must=r"^\S+: [\d.]+e[-+]\d+ from the plain run's after restore \(a shard kept the EMA\)")


def test_a_lone_save_pretrained_at_the_end_of_a_script_is_served_at_its_exit(tmp_path: Path) -> None:
    """tests/scripts/lone_save_at_exit.py under torchrun: the main process's `save_pretrained`
    alone after `wait_for_everyone()`, the other process already at its interpreter's exit (no
    `end_training()`): served there; the saved folder is the gathered weights, bit for bit."""
    from transformers import GPT2LMHeadModel

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "lone_save_at_exit.py"), "--out", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("SHARDWISE_CONFIG", None)
    start = time.monotonic()
    proc = run_command(cmd, cwd=tmp_path, env=env, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert time.monotonic() - start < 60, log[-4000:]  # no wait for a timeout
    said = [ln for ln in log.splitlines() if ln.startswith("shardwise: the main process's 1 save_pretrained "
                                                          "gather(s) alone after wait_for_everyone()")]
    assert len(said) == 1 and said[0].endswith("until the end of the script"), log[-4000:]
    gathered = torch.load(tmp_path / "gathered.pt")
    saved = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved")).state_dict()
    for name, tensor in gathered.items():
        assert torch.equal(saved[name], tensor), name


def _generate_run(backend: str) -> dict[str, Any]:
    import workloads as W

    import shardwise

    acc = shardwise.Accelerator(cpu=True, strategy="zero3", backend=backend, seed=W.SEED,
                                collective_timeout_s=30)
    model = W.build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    data, rank, main = W.Tokens(5).data, acc.process_index, acc.is_main_process
    out: dict[str, Any] = {"losses": []}

    def train(i: int) -> None:
        loss = W.lm_loss(model, data[2 * i + rank:2 * i + rank + 1])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        out["losses"].append(acc.reduce(loss.detach(), "mean").item())

    train(0)
    served: list[torch.Tensor] = []
    if not main:  # (what the other process's generate makes when it serves the main process's)
        inner = acc.unwrap_model(model)
        generate = inner.__dict__["generate"]
        inner.__dict__["generate"] = lambda *a, **k: served.append(generate(*a, **k)) or served[-1]
    rng = torch.get_rng_state()
    acc.wait_for_everyone()
    try:
        if main:  # alone: the other process is at the gather below
            out.update(_generations(model, acc.unwrap_model(model), data[-1:, :4]))
        out["gathered"] = acc.gather(torch.tensor([rank])).tolist()
    except RuntimeError as err:  # not served: a wait ran out (said in the result); any other error is a crash
        from shardwise.runtime.supervision import is_timeout

        if not (is_timeout(err) or "waited" in str(err)):
            raise
        out["lone_error"] = str(err).strip().splitlines()[0]
        torch.distributed.destroy_process_group()  # (past a timeout the group is not used again)
        return out
    out["served"] = served
    out["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    train(1)
    if main:  # alone with no barrier before it: refused in one line, not hung
        start = time.monotonic()
        try:
            model.generate(data[-1:, :4], max_new_tokens=2, pad_token_id=0)
            out["unsettled"] = "ran"
        except RuntimeError as err:
            out["unsettled"] = str(err)
        out["unsettled_s"] = time.monotonic() - start
    acc.wait_for_everyone()
    out["weights"] = acc.get_state_dict(model)
    return out


def _generations(model: torch.nn.Module, inner: Any, prompt: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    sampled = model.generate(prompt, do_sample=True, top_k=0, max_new_tokens=4, pad_token_id=0)
    greedy = inner.generate(prompt, do_sample=False, max_new_tokens=3, pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    return {"sampled": sampled, "greedy": greedy, "logits": logits}


def _generate_plain() -> dict[str, Any]:
    import workloads as W

    model = W.build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = W.Tokens(5).data
    out: dict[str, Any] = {"losses": []}
    for i in range(2):
        loss = (W.lm_loss(model, data[2 * i:2 * i + 1]) + W.lm_loss(model, data[2 * i + 1:2 * i + 2])) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        if i == 0:
            out.update(_generations(model, model, data[-1:, :4]))
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def check_generate_served(fn: Any) -> None:
    """`fn` on 2 processes against one plain process (a worker that crashes or hangs fails the
    test: a crash is not a check's finding)."""
    runs = spawn(fn, 2, timeout=120)
    errors = [f"rank {rank}: {run['lone_error']}" for rank, run in enumerate(runs) if "lone_error" in run]
    assert not errors, f"the lone generate was not served: {'; '.join(errors)}"
    main, plain = runs[0], _generate_plain()
    assert main["gathered"] == runs[1]["gathered"] == [0, 1]
    assert runs[1]["rng_kept"], "the serving process's random state moved"
    assert main["sampled"].shape == (1, 8) and torch.equal(main["sampled"], plain["sampled"]), \
        (main["sampled"], plain["sampled"])
    assert torch.equal(main["greedy"], plain["greedy"]), (main["greedy"], plain["greedy"])
    served = runs[1]["served"]  # the other process ran each generate as the main process did
    assert len(served) == 2 and torch.equal(served[1], main["greedy"]), served
    assert torch.equal(served[0], main["sampled"]), \
        f"the serving process sampled other tokens: {served[0].tolist()} against {main['sampled'].tolist()}"
    assert main["unsettled"].startswith("a forward of the sharded GPT2LMHeadModel ran on one process alone") \
        and "\n" not in main["unsettled"] and main["unsettled_s"] < 10, main["unsettled"]
    torch.testing.assert_close(main["logits"], plain["logits"], rtol=1e-5, atol=1e-5)
    for run in runs:
        for a, b in zip(run["losses"], plain["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (run["losses"], plain["losses"])
    for name, want in plain["weights"].items():
        worst = (main["weights"][name] - want).abs().max().item()
        # (two AdamW steps at lr 1e-2 from 2 processes' gradients against one's: up to 2.2e-5 on a
        # bias whose gradient is near zero, by CPU and transformers version; a served call that
        # trained or kept a copy would move weights by about lr)
        assert worst <= 1e-4, f"{name}: {worst:.2e} from the plain run's"


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_lone_generate_after_a_barrier_is_served(backend: str) -> None:
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    check_generate_served(functools.partial(_generate_run, backend))


def test_a_fault_that_only_raises_is_not_caught() -> None:
    """`lone_generate_raises`: the main process's generate only raises. The check never sees a
    number; the worker's error comes out of `caught` as the error it is, not as a catch."""
    run = functools.partial(_generate_run, "torch")
    with pytest.raises(RuntimeError, match="planted: generate raised"):
        caught(check_generate_served, planted(run, "lone_generate_raises"), must="not served")


def test_planted_lone_generate_own_rng_is_caught() -> None:
    """`lone_generate_own_rng`: the serving process samples from its own random state; its
    generation's tokens are not the main process's."""
    run = functools.partial(_generate_run, "torch")
    caught(check_generate_served, planted(run, "lone_generate_own_rng"),
           must="the serving process sampled other tokens")


def test_planted_lone_generate_unwatched_is_caught() -> None:
    """`lone_generate_unwatched`: the engine's check is not put before the model's generate, so
    FSDP2 gathers the root on the main process alone: the other process, waiting for the main
    process's word, gives up after the collective timeout (30 s here), and the run fails."""
    run = functools.partial(_generate_run, "torch")
    caught(check_generate_served, planted(run, "lone_generate_unwatched"),
           must=r"the lone generate was not served: .*waited 30 s after wait_for_everyone\(\)")
