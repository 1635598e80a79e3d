"""LoRA (peft) on a tiny GPT-2 at 2 processes against one plain process, on torch zero2/zero3 and
DeepSpeed zero3: losses and LoRA weights, the frozen base untouched, gradients and optimizer
state held for the trainable share only, greedy `generate()` of the sharded peft model, and the
saves: `save_model` writes an adapter folder that peft reloads in a plain process (or, with
`merge_adapters=True`, a plain transformers folder), and the main-process `save_pretrained` is
refused in one line unless given the full state dict (the Accelerate idiom, which then works).

Tolerances are the equivalence tests' (losses 1e-5, weights 2e-5). Reloaded folders are compared
with the trained sharded model's own logits on the same tokens: the same fp32 weights computed
without sharding, within 1e-5 (measured: adapter bit-identical, merged 9e-8; LoRA weights 5.4e-7
from one process), and the same greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import run_command, spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("deepspeed") is None,
    reason="peft or deepspeed not installed (pip install 'shardwise[peft,deepspeed]'); CI installs both",
)

CASES = [("torch", "zero2"), ("torch", "zero3"), ("deepspeed", "zero3")]
STEPS, BATCH, LR = 3, 2, 1e-2


def _key(case: tuple[str, str]) -> str:
    return ":".join(case)


def lora(model: torch.nn.Module) -> Any:
    """GPT-2 with rank-4 LoRA on its attention and MLP projections (Conv1D: fan_in_fan_out)."""
    import peft

    torch.manual_seed(99)  # the same lora_A draw on every process and in the reference
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                             fan_in_fan_out=True)
    return peft.get_peft_model(model, config)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _batches(world: int) -> torch.Tensor:
    return W.Tokens(STEPS * BATCH * world).data.view(STEPS, world * BATCH, -1)


EVAL_IDS = W.Tokens(2, seed=3).data


def _prompts() -> dict[str, Any]:
    """Greedy generation of 5 tokens after the first 3 of EVAL_IDS (8 positions: W.SEQ)."""
    ids = EVAL_IDS[:, :3]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 5,
            "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # an FSDP2 DTensor: this process's shard
    return int(local.numel() * local.element_size())


def _grad_bytes(model: Any) -> int:
    """Gradient bytes this process holds after a backward: the parameters' `.grad` (FSDP2
    shards), plus DeepSpeed ZeRO-3's flat buffer of this rank's gradient partitions."""
    held = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    ds_engine = getattr(model, "ds_engine", None)
    buffer = getattr(getattr(ds_engine, "optimizer", None), "grad_partitions_flat_buffer", None)
    return held + (_nbytes(buffer) if buffer is not None else 0)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of Adam's moments (not the step counters) the torch optimizer holds on this process."""
    return sum(_nbytes(v) for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.ndim)


@dataclass(frozen=True, slots=True)
class Adapted:
    """A LoRA run: losses, gathered weights, eval logits and greedy tokens after training, what a
    lone save_pretrained on the main process said (None elsewhere), the trainable elements, and
    the gradient and optimizer-state bytes this process held."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    logits: torch.Tensor
    tokens: torch.Tensor
    refusal: str | None
    trainable: int
    grad_bytes: int
    state_bytes: int


@dataclass(frozen=True, slots=True)
class Reference:
    """One plain process: losses, final weights, and the weights it started from."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]


def _train(backend: str, strategy: str, folder: str) -> Adapted:
    import shardwise

    engine = shardwise.Engine(backend=backend, strategy=strategy, cpu=True, seed=W.SEED)
    model = lora(W.build("gpt2"))
    opt = _optimizer(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model, opt = engine.prepare(model, opt)
    rank, losses, grads = engine.process_index, [], 0
    for step, ids in enumerate(_batches(engine.num_processes)):
        loss = W.lm_loss(model, ids[rank * BATCH : (rank + 1) * BATCH])
        engine.backward(loss)
        losses.append(engine.reduce(loss.detach(), "mean").item())
        if step == 0:
            grads = _grad_bytes(model)
        opt.step()
        opt.zero_grad()
    inner = opt.optimizer  # the user's AdamW (on DeepSpeed: over this rank's flat fp32 partitions)
    model.eval()
    with torch.no_grad():  # every process runs the same tokens: a collective forward under zero3
        logits = model(input_ids=EVAL_IDS).logits.float().cpu()
        # peft's generate calls the inner model's forward: every process generates together
        tokens = engine.unwrap_model(model).generate(**_prompts(), synced_gpus=True).cpu()
    state = engine.get_state_dict(model)
    engine.save_model(model, f"{folder}/adapter")
    engine.save_model(model, f"{folder}/merged", merge_adapters=True)
    full = engine.get_state_dict(model)  # the Accelerate idiom: every process gathers, main saves
    refusal = None
    if engine.is_main_process:
        engine.unwrap_model(model).save_pretrained(f"{folder}/idiom", state_dict=full)
        try:
            engine.unwrap_model(model).save_pretrained(f"{folder}/direct")  # alone: refused
            refusal = "written"
        except RuntimeError as err:
            refusal = str(err)
    engine.wait_for_everyone()  # (the others moved on: the main process knows it is alone at once)
    engine.free_memory()
    return Adapted(losses, state, logits, tokens, refusal, trainable, grads, _state_bytes(inner))


def _runs(folder: str) -> dict[tuple[str, str], Adapted]:
    return {case: _train(*case, f"{folder}/{_key(case)}") for case in CASES}


def _reference(world: int) -> Reference:
    model = lora(W.build("gpt2"))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = _optimizer(model)
    losses = []
    for ids in _batches(world):
        loss = W.lm_loss(model, ids)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return Reference(losses, model.state_dict(), initial)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("adapters")
    ranks = spawn(_runs, 2, str(folder), timeout=1200)  # a fresh machine first builds DeepSpeed's shm op
    return {"ranks": ranks, "folder": folder, "ref": _reference(2)}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=EVAL_IDS).logits.float()


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_lora_trains_as_one_process(runs: dict[str, Any], case: tuple[str, str]) -> None:
    got, ref = runs["ranks"][0][case], runs["ref"]
    assert W.close(got.losses, ref.losses) <= 1e-5, (got.losses, ref.losses)
    lora_keys = {k for k in ref.state if "lora_" in k}
    assert len(lora_keys) == 12 and got.state.keys() == ref.state.keys()
    assert W.max_diff({k: got.state[k] for k in lora_keys},
                      {k: ref.state[k] for k in lora_keys}) <= 2e-5
    moved = max((ref.state[k] - ref.initial[k]).abs().max().item() for k in lora_keys)
    assert moved > 1e-3  # the adapter really trained
    for k in ref.state.keys() - lora_keys:  # the frozen base, bit for bit
        assert torch.equal(got.state[k], ref.initial[k]), k


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_grads_and_optimizer_hold_the_trainable_share(runs: dict[str, Any], case: tuple[str, str]) -> None:
    """fp32: each of 2 processes holds half the trainable gradients and half of Adam's two
    moments (the LoRA shapes split evenly: no padding), nothing for the frozen base."""
    for rank in runs["ranks"]:
        got = rank[case]
        share = 4 * got.trainable // 2
        assert (got.grad_bytes, got.state_bytes) == (share, 2 * share), (
            got.grad_bytes, got.state_bytes)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_adapter_folder_reloads_in_a_plain_process(runs: dict[str, Any], case: tuple[str, str]) -> None:
    import peft

    folder = runs["folder"] / _key(case)
    trained = runs["ranks"][0][case].logits
    assert sorted(p.name for p in (folder / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((folder / "adapter" / "adapter_config.json").read_text())["r"] == 4
    base_logits = _logits(W.build("gpt2"))
    for name in ("adapter", "idiom"):  # save_model's, and save_pretrained given the full state dict
        reloaded = peft.PeftModel.from_pretrained(W.build("gpt2"), str(folder / name))
        assert (_logits(reloaded) - trained).abs().max().item() <= 1e-5, name
        assert torch.equal(reloaded.generate(**_prompts()), runs["ranks"][0][case].tokens), name
    assert (base_logits - trained).abs().max().item() > 1e-3  # the adapter changes the output


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_merged_export_loads_with_transformers(runs: dict[str, Any], case: tuple[str, str]) -> None:
    check_merged(runs["folder"] / _key(case) / "merged", runs["ranks"][0][case].logits)


def check_merged(folder: Path, logits: torch.Tensor) -> None:
    """The merged export: the base model's own keys only, loaded by transformers, the trained
    (adapted) model's logits within 1e-5."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and not any("lora_" in k or "base_layer" in k or k.startswith("base_model.") for k in keys)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert isinstance(model, GPT2LMHeadModel)
    worst = (_logits(model) - logits).abs().max().item()
    assert worst <= 1e-5, f"the merged export's logits are {worst:.2e} from the trained model's"


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_main_process_save_pretrained_is_refused(runs: dict[str, Any], case: tuple[str, str]) -> None:
    refusal = runs["ranks"][0][case].refusal
    assert ("\n" not in refusal and "sharded" in refusal
            and "engine.save_model(model, dir)" in refusal), refusal
    assert not (runs["folder"] / _key(case) / "direct").exists()


def test_shardwise_works_without_peft() -> None:
    """No peft installed (simulated by blocking its import): shardwise imports, saves plain models."""
    code = ("import sys; sys.modules['peft'] = None\n"
            "import torch, shardwise\nfrom shardwise.weights.adapters import is_peft_model\n"
            "assert not is_peft_model(torch.nn.Linear(2, 2))\nprint('ok')")
    proc = run_command([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_merge_adapters_refused_for_a_plain_model(tmp_path: Path) -> None:
    import shardwise
    from shardwise.checkpoint.storage import CheckpointError

    engine = shardwise.Engine(cpu=True)
    model = engine.prepare(W.build("tiny"))
    with pytest.raises(CheckpointError, match="merge_adapters=True\\): TinyLM is not a peft model; "
                                              "drop merge_adapters"):
        engine.save_model(model, tmp_path / "m", merge_adapters=True)
    assert not (tmp_path / "m").exists()


def _planted_zero3(folder: str) -> Adapted:
    return _train("torch", "zero3", folder)  # (as the real test's torch zero3 case)


def test_an_export_that_drops_the_adapter_is_caught(tmp_path: Path) -> None:
    run = spawn(planted(_planted_zero3, "adapter_not_merged"), 2, str(tmp_path))[0]
    caught(check_merged, tmp_path / "merged", run.logits,
           must=r"the merged export's logits are [\d.]+e[-+]\d+ from the trained model's")
