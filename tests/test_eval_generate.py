"""Evaluation and generation between training steps, at 2 CPU processes on a tiny GPT-2: what each
process holds, what `memory_report()` says it holds, and `generate()` with different prompts and
lengths per process, on torch zero2/zero3 and DeepSpeed zero2/zero3 (and a peft model on torch
zero3), against one plain process.

Held parameter elements are counted directly from the storages each process keeps: FSDP2's shard
and its gathered parameter when allocated, DeepSpeed ZeRO-3's partition and its gathered
parameter when not empty. After an evaluation forward under no_grad and after `generate()` they
must be the shard at rest (the whole model under DeepSpeed zero2, which replicates parameters).
Inside the forward (after each block), torch zero3 holds at most the shard plus one block plus
the root's own parameters (embeddings, final norm), which FSDP2 gathers for the whole forward;
zero2 holds its blocks to the end of the forward, and DeepSpeed's zero3 prefetches
`stage3_prefetch_bucket_size` elements ahead (here the whole tiny model).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch import nn

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_PEFT = importlib.util.find_spec("peft") is not None
CASES = [("torch", "zero3", "gpt2"), ("torch", "zero2", "gpt2")]
CASES += [("deepspeed", "zero3", "gpt2"), ("deepspeed", "zero2", "gpt2")] if HAS_DEEPSPEED else []
CASES += [("torch", "zero3", "peft")] if HAS_PEFT else []
# per rank: (prompt length, new tokens); positions stay within W.SEQ (8)
LENGTHS = [(2, 2), (3, 5)]


def _build(kind: str) -> nn.Module:
    model = W.build("gpt2")
    if kind == "peft":
        import peft

        torch.manual_seed(99)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                           fan_in_fan_out=True))
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("GPT2Block")]  # FSDP2 renames the class


@dataclass(frozen=True, slots=True)
class Held:
    """One process of a case: the model's and its largest block's elements; the elements held at
    rest after a step, after each block of an eval forward (with memory_report's params bytes),
    after it (and memory_report's params bytes then), after generate; the generated tokens; the
    gathered weights; what each save_pretrained on the main process did ({} elsewhere)."""

    full: int
    block: int
    rest: int
    during: list[tuple[int, int]]
    after_eval: int
    report: int
    after_generate: int
    tokens: torch.Tensor
    state: dict[str, torch.Tensor]
    saved: dict[str, str]


def _run(backend: str, strategy: str, kind: str, folder: str) -> Held:
    import shardwise

    engine = shardwise.Engine(backend=backend, strategy=strategy, cpu=True, seed=W.SEED)
    model = _build(kind)
    full = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in _blocks(model))
    opt = W.make_optimizer(model)
    model, opt = engine.prepare(model, opt)
    inner, rank = engine.unwrap_model(model), engine.process_index
    ids = W.Tokens(4).data
    engine.backward(W.lm_loss(model, ids[2 * rank : 2 * rank + 2]))  # a training step first
    opt.step()
    opt.zero_grad()
    rest = W.held_elements(inner)
    during: list[tuple[int, int]] = []  # (held, memory_report's params bytes) after each block
    def note(*_: Any) -> None:
        during.append((W.held_elements(inner), engine.memory_report().params))

    hooks = [b.register_forward_hook(note) for b in _blocks(inner)]
    model.eval()
    with torch.no_grad():
        model(input_ids=ids[:2])
    for h in hooks:
        h.remove()
    after_eval, report = W.held_elements(inner), engine.memory_report().params
    n, new = LENGTHS[rank]
    prompt = ids[rank : rank + 1, :n]
    # the prepared model's own generate (no unwrap_model), with synced_gpus=False: must not hang
    tokens = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=False)
    after_generate = W.held_elements(inner)
    state = engine.get_state_dict(model)
    saved: dict[str, Any] = {}
    if engine.is_main_process:
        for name, target in (("prepared", model), ("unwrapped", inner)):
            try:
                target.save_pretrained(f"{folder}/{backend}-{strategy}-{kind}-{name}")
                saved[name] = "written"
            except RuntimeError as err:
                saved[name] = str(err)
    engine.wait_for_everyone()  # (the others moved on: the main process knows it is alone at once)
    engine.free_memory()
    return Held(full, block, rest, during, after_eval, report, after_generate, tokens, state, saved)


def _all(folder: str) -> dict[tuple[str, str, str], Held]:
    return {case: _run(*case, folder) for case in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("evalgen")
    return {"ranks": spawn(_all, 2, str(folder), timeout=1200), "folder": folder}


def _key(case: tuple[str, str, str]) -> str:
    return ":".join(case)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_eval_forward_and_generate_hold_only_the_shard(
    runs: dict[str, Any], case: tuple[str, str, str]
) -> None:
    check_held(runs["ranks"], case)


def test_an_eval_forward_left_gathered_is_caught(tmp_path: Path) -> None:
    case = ("torch", "zero2", "gpt2")  # zero2: the root stays gathered after a forward under no_grad
    worker = planted(_run, "eval_forward_left_gathered")
    caught(check_held, [{case: held} for held in spawn(worker, 2, *case, str(tmp_path))], case,
           must=r"^held after eval 41664, after generate \d+, its shard 13888")


def check_held(ranks: list[dict[Any, Held]], case: tuple[str, str, str]) -> None:
    for r in ranks:
        run = r[case]
        replicated = case[:2] == ("deepspeed", "zero2")  # DeepSpeed's zero2 keeps whole parameters
        assert run.rest == (run.full if replicated
                               else pytest.approx(run.full / 2, rel=0.02)), run.rest
        assert run.after_eval == run.rest and run.after_generate == run.rest, \
            f"held after eval {run.after_eval}, after generate {run.after_generate}, its shard " \
            f"{run.rest}: {run}"
        peak = max(h for h, _ in run.during)
        if case[:2] == ("torch", "zero3"):  # FSDP2 reshards each block after its forward
            root = run.full - 2 * run.block  # embeddings and final norm (tiny GPT-2: 2 blocks)
            assert peak <= run.full / 2 + run.block + root, run.during
        else:  # zero2 holds its blocks to the end of the forward; DeepSpeed prefetches a bucket ahead
            assert peak <= run.rest + run.full, run.during


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_memory_report_counts_what_is_held(runs: dict[str, Any], case: tuple[str, str, str]) -> None:
    for r in runs["ranks"]:
        run = r[case]
        assert run.report == 4 * run.after_eval
        assert [rep for _, rep in run.during] == [4 * h for h, _ in run.during], run.during


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_generate_with_different_lengths_per_rank_equals_one_process(
    runs: dict[str, Any], case: tuple[str, str, str]
) -> None:
    ref = _build(case[2])
    ref.load_state_dict(runs["ranks"][0][case].state)
    ref.eval()
    ids = W.Tokens(4).data
    for rank, r in enumerate(runs["ranks"]):
        n, new = LENGTHS[rank]
        prompt = ids[rank : rank + 1, :n]
        want = ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert torch.equal(r[case].tokens, want), (rank, r[case].tokens, want)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_main_process_save_is_full_or_refused(runs: dict[str, Any], case: tuple[str, str, str]) -> None:
    saved, folder = runs["ranks"][0][case].saved, Path(runs["folder"])
    for name, outcome in saved.items():
        target = folder / f"{'-'.join(case)}-{name}"
        if case[:2] == ("deepspeed", "zero2"):  # whole parameters on every process: a full save
            from safetensors.torch import load_file

            assert outcome == "written", outcome
            written = load_file(str(target / "model.safetensors"))
            state = runs["ranks"][0][case].state
            assert all(torch.equal(written[k], state[k]) for k in written), name
        else:
            assert "\n" not in outcome and "engine.save_model(model, dir)" in outcome, outcome
            assert not target.exists()
