"""Started without a launcher, the engine is a world of size one and every strategy still runs."""

from __future__ import annotations

import pytest
import torch
import workloads as W
from planted import caught, planted_here
from torch.utils.data import DataLoader

import shardwise

RUN = {"batch": 4, "accum": 2, "steps": 2}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_world_of_one_matches_plain_pytorch(strategy: str) -> None:
    run = W.train_engine("tiny", {"cpu": True, "strategy": strategy}, **RUN)
    ref = W.reference("tiny", world=1, **RUN)
    assert W.close(run.losses, ref.losses) < 1e-5
    assert W.max_diff(run.state, ref.state) < 2e-5


def test_dataloader_order_is_seeded_and_reshuffles_per_epoch() -> None:
    engine = shardwise.Engine(cpu=True, seed=3)
    loader = engine.prepare(DataLoader(list(range(10)), batch_size=5, shuffle=True))
    first = [b.tolist() for b in loader]
    second = [b.tolist() for b in loader]  # a new pass is a new epoch
    loader.set_epoch(0)
    again = [b.tolist() for b in loader]
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    assert [i for batch in first for i in batch] == expected
    assert first == again and first != second
    assert sorted(i for batch in second for i in batch) == list(range(10))


def test_batches_land_on_the_engine_device() -> None:
    engine = shardwise.Engine(cpu=True)
    data = [{"x": torch.ones(2), "meta": "a"} for _ in range(4)]
    loader = engine.prepare(DataLoader(data, batch_size=2))
    batch = next(iter(loader))
    assert batch["x"].device == engine.device and batch["meta"] == ["a", "a"]


def test_save_model_writes_loadable_safetensors(tmp_path) -> None:
    from safetensors.torch import load_file

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = engine.prepare(W.build("tiny"))
    engine.save_model(model, tmp_path / "out")
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert W.max_diff(loaded, W.build("tiny").state_dict()) == 0.0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_save_model_transformers_roundtrip(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    engine = shardwise.Engine(strategy="zero3", cpu=True)
    model = engine.prepare(W.build("gpt2"))
    engine.save_model(model, tmp_path / "gpt2")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    ids = W.Tokens(2).data
    with torch.no_grad():
        assert torch.equal(back(ids).logits, W.build("gpt2")(ids).logits)


def test_step_counts_every_boundary_whichever_optimizer_steps() -> None:
    """Two optimizers, the first prepared stepping every other iteration only (a GAN-style
    loop): `engine.step` counts optimizer steps, one per iteration, not the first one's."""
    check_step_counts()


def test_steps_counted_by_one_optimizer_are_caught() -> None:
    with planted_here("steps_of_the_first_optimizer"):
        caught(check_step_counts, must=r"^engine\.step 3 after 6 steps")


def check_step_counts() -> None:
    engine = shardwise.Engine(cpu=True)
    a, b = W.build("tiny"), W.build("tiny")
    opt_a, opt_b = W.make_optimizer(a), W.make_optimizer(b)
    a, b, opt_a, opt_b = engine.prepare(a, b, opt_a, opt_b)
    ids = W.Tokens(2).data
    for i in range(6):
        with engine.accumulate(a, b):
            engine.backward(W.lm_loss(a, ids) + W.lm_loss(b, ids))
            if i % 2 == 0:
                opt_a.step()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
    assert engine.step == 6, \
        f"engine.step {engine.step} after 6 steps of the second optimizer (3 of the first)"


class _Kernels:
    """The aten ops a block dispatches, by name (what actually ran, not what was configured)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        names: set[str] = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                names.add(str(func.name()))
                return func(*args, **(kwargs or {}))

        self.names, self.mode = names, Mode()


@pytest.mark.parametrize(("strategy", "offload", "optimizer", "kernel"), [
    ("zero2", "optimizer", "AdamW", "aten::_fused_adamw_"),
    ("zero3", "params", "AdamW", "aten::_fused_adamw_"),
    ("zero1", "optimizer", "AdamW", "aten::_fused_adamw_"),
    ("zero2", "optimizer", "SGD", "aten::_fused_sgd_"),
])
def test_the_host_step_runs_torchs_fused_kernel(strategy: str, offload: str, optimizer: str,
                                                kernel: str) -> None:
    check_fused_host_step(strategy, offload, optimizer, kernel)


def test_planted_host_step_unfused_is_caught() -> None:
    """`host_step_unfused`: the host step keeps the optimizer's own loop; no fused kernel ran."""
    with planted_here("host_step_unfused"):
        caught(check_fused_host_step, "zero2", "optimizer", "AdamW", "aten::_fused_adamw_",
               must=r"^no aten::_fused_adamw_ among the ops the step ran: \[.*'aten::addcdiv_'")  # the loop


def check_fused_host_step(strategy: str, offload: str, optimizer: str, kernel: str) -> None:
    """The fused host step row: an offloaded optimizer step dispatches torch's fused CPU kernel for
    the user's class (seen as the aten op that ran), and no per-tensor loop of the unfused path."""
    engine = shardwise.Engine(strategy=strategy, offload=offload, cpu=True)
    model = W.build("tiny")
    opt_class = getattr(torch.optim, optimizer)
    kwargs = {"momentum": 0.9} if optimizer == "SGD" else {}
    model, opt = engine.prepare(model, opt_class(model.parameters(), lr=1e-3, **kwargs))
    engine.backward(W.lm_loss(model, W.Tokens(2).data))
    kernels = _Kernels()
    with kernels.mode:
        opt.step()
    engine.free_memory()
    assert kernel in kernels.names, f"no {kernel} among the ops the step ran: {sorted(kernels.names)}"
    unfused = {"aten::_foreach_lerp_", "aten::lerp_", "aten::addcdiv_"}  # AdamW's loop and foreach paths
    assert not unfused & kernels.names, sorted(unfused & kernels.names)
