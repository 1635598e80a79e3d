"""Bad input is refused before any work starts, with a message naming the value and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted_here
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import ConfigError
from shardwise.strategies.precision import check_device_supports


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"strategy": "zero4"}, ["strategy='zero4'", "ddp, zero1, zero2, zero3"]),
        ({"strategy": "zer3"}, ["did you mean 'zero3'"]),
        ({"precision": "fp8"}, ["precision='fp8'", "fp32, bf16, fp16"]),
        ({"offload": "disk"}, ["offload='disk'", "none, optimizer, params"]),
        ({"strategy": "zero2", "offload": "params"}, ["offload='params' needs strategy='zero3'"]),
        ({"strategy": "ddp", "offload": "optimizer"}, ["needs a sharded strategy"]),
        ({"grad_accum_steps": 0}, ["grad_accum_steps=0"]),
        ({"stratgey": "zero3"}, ["unknown setting 'stratgey'", "did you mean 'strategy'"]),
        ({"mixed_precision": "fp8"}, ["mixed_precision='fp8'", "no, bf16, fp16"]),
        ({"collective_timeout_s": 0.05}, ["collective_timeout_s=0.05 is too short", "at least 5"]),
        ({"resume": "yes"}, ["resume='yes' is not valid", "auto, required, never"]),
        ({"progress": "yes"}, ["progress='yes' must be true, false or None"]),
        ({"training": {"grad_accum_steps": 0}}, ["training.grad_accum_steps=0 must be an integer >= 1"]),
        ({"strategy": "ddp", "expert_parallel_size": 2},
         ["expert_parallel_size=2 needs strategy zero1, zero2 or zero3 (got ddp)"]),
        ({"training": {"grad_accum_steps": 1}, "grad_accum_steps": 4},
         ["training.grad_accum_steps=1 and grad_accum_steps=4 disagree; set one of them"]),
    ],
)
def test_bad_engine_settings(kwargs: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        shardwise.Engine(cpu=True, **kwargs)
    for needle in needles:
        assert needle in str(err.value)
    assert "\n" not in str(err.value)  # one line


def test_precision_the_device_cannot_run() -> None:
    with pytest.raises(ConfigError, match="precision='bf16' cannot run on device meta"):
        check_device_supports("bf16", torch.device("meta"))


def test_accelerate_spellings_map_to_ours() -> None:
    engine = shardwise.Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=3)
    assert engine.config.sharding.precision == "fp32" and engine.config.training.grad_accum_steps == 3


@pytest.fixture()
def engine() -> shardwise.Engine:
    return shardwise.Engine(strategy="zero3", cpu=True)


def test_prepare_refuses_unknown_objects(engine: shardwise.Engine) -> None:
    with pytest.raises(TypeError, match=r"prepare\(\) cannot handle builtins.str"):
        engine.prepare("model.pt")


def test_optimizer_of_unprepared_model_is_refused_before_any_sharding(engine: shardwise.Engine) -> None:
    model, other = W.build("tiny"), W.build("tiny")
    with pytest.raises(ValueError, match=r"AdamW holds \d+ parameter\(s\) of no prepared model"):
        engine.prepare(model, W.make_optimizer(other))
    assert type(model) is W.TinyLM  # nothing was sharded


def test_wrap_matching_nothing(engine: shardwise.Engine) -> None:
    picky = shardwise.Engine(strategy="zero3", cpu=True, wrap=("GPT2Block",))
    with pytest.raises(ConfigError, match="wrap=\\['GPT2Block'\\] matches no submodule of TinyLM"):
        picky.prepare(W.build("tiny"))


def test_scheduler_of_unprepared_optimizer(engine: shardwise.Engine) -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="StepLR's optimizer was not prepared"):
        engine.prepare(torch.optim.lr_scheduler.StepLR(opt, 1))


def test_model_prepared_twice(engine: shardwise.Engine) -> None:
    model = engine.prepare(W.build("tiny"))
    with pytest.raises(ValueError, match="already prepared"):
        engine.prepare(model)


def test_custom_batch_sampler_is_refused(engine: shardwise.Engine) -> None:
    sampler = torch.utils.data.BatchSampler(range(8), batch_size=2, drop_last=False)
    with pytest.raises(TypeError, match="needs a DataLoader built with batch_size"):
        engine.prepare(DataLoader(W.Tokens(8), batch_sampler=sampler))


def test_contradicting_train_batch_size_is_refused_before_sharding() -> None:
    engine = shardwise.Engine(strategy="zero3", cpu=True, train_batch_size=5)
    model = W.build("tiny")
    with pytest.raises(
        ConfigError, match=r"train_batch_size=5 but micro_batch_size 2 x grad_accum_steps 1 x 1 processes = 2"
    ):
        engine.prepare(model, DataLoader(W.Tokens(8), batch_size=2))
    assert type(model) is W.TinyLM  # nothing was sharded


def test_careless_calls_get_one_line_before_any_work() -> None:
    check_careless_calls()


def check_careless_calls() -> None:
    engine = shardwise.Engine(strategy="zero3", cpu=True)
    refusals = []
    with pytest.raises(RuntimeError, match=r"backward\(\) before prepare\(\): prepare the model") as err:
        engine.backward(torch.ones((), requires_grad=True))
    refusals.append(err.value)
    frozen = W.build("tiny").requires_grad_(False)  # alone it is prepared for inference (test_finetune)
    with pytest.raises(
        ValueError, match=r"AdamW holds 23 parameter\(s\) of TinyLM, which has no trainable parameters"
    ) as err:
        engine.prepare(frozen, W.make_optimizer(frozen))
    refusals.append(err.value)
    model = engine.prepare(W.build("tiny"))
    engine.backward(W.lm_loss(model, W.Tokens(2).data))
    for bad in (-1.0, 0.0):
        with pytest.raises(
            ValueError, match=r"clip_grad_norm_\(max_norm=.*\): the bound must be a number > 0"
        ) as err:
            engine.clip_grad_norm_(model.parameters(), bad)
        refusals.append(err.value)
    assert all("\n" not in str(e) for e in refusals), refusals


def test_a_clip_bound_left_unchecked_is_caught() -> None:
    with planted_here("clip_bound_unchecked"):
        caught(check_careless_calls, must=r"DID NOT RAISE .*ValueError")  # clip_grad_norm_(ps, -1.0) taken


def test_a_word_for_a_number_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise import cli

    with pytest.raises(SystemExit) as code:
        cli.main(["launch", "--num-processes", "two", "train.py"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1
    assert "argument --num-processes: 'two' is not a whole number (e.g. 2)" in err


class _Held:
    """An output class torch's pytree does not know (FSDP2 cannot find the tensors inside)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _HeldOutput(nn.Module):
    """Two sharded blocks and a head on the root: the root's parameters are needed in backward."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 8)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return {"logits": logits} if self.as_dict else _Held(logits)


def test_an_output_fsdp_cannot_look_into_is_refused_at_its_forward() -> None:
    """zero3: a forward returning an object torch's pytree does not know, its tensors inside, is
    refused in one line at that forward (before: backward crashed in torch with "setStorage ...
    storage of size 0"); the same forward under no_grad (no backward) and a dict output train."""
    for as_dict in (False, True):
        engine = shardwise.Engine(strategy="zero3", cpu=True, wrap=(_Block,))
        torch.manual_seed(0)
        model = _HeldOutput(as_dict)
        model, opt = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        x = torch.randn(4, 8)
        with torch.no_grad():
            model(x)  # evaluation: nothing to refuse
        if as_dict:
            engine.backward(model(x)["logits"].sum())
            opt.step()
        else:
            with pytest.raises(ConfigError) as err:
                model(x)
            said = W.one_line(err.value)
            assert said.startswith("_HeldOutput.forward returned _Held, whose tensors FSDP cannot find "
                                   "(_Held.logits needs a gradient)"), said
        engine.free_memory()
