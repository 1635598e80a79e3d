"""Issue 33: every way transformers runs a sharded model, against one plain process.

A tiny T5 (encoder-decoder, one `shared` embedding tied to both stacks and the head) and a tiny
BERT masked LM (word embeddings tied to the decoder; transformers 5 lists `BertEmbeddings` among
its blocks) on 2 processes, torch zero2 and zero3 and DeepSpeed zero3:
- tied parameters stay one parameter in one sharding unit (BERT's embeddings join the root);
- `generate` (the encoder called directly by transformers), `get_encoder()(...)`,
  `get_decoder()(...)`, and a submodule called on its own (`model.shared(ids)`) give one plain
  process's outputs (greedy tokens equal; hidden states within 1e-5), and after each no-grad
  call every unit holds only its shard again;
- a training step whose loss comes from `get_encoder()` called directly (the root's shared
  embedding gets its gradient through the direct call) leaves the weights of one plain process
  that took the same step (2e-5, the equivalence tests' tolerance).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from spawn import spawn
from torch import nn

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
CONFIGS = [("torch", "zero2"), ("torch", "zero3")] + ([("deepspeed", "zero3")] if HAS_DEEPSPEED else [])
VOCAB = 64


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, max_position_embeddings=16))


IDS = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
DEC = torch.randint(2, VOCAB, (2, 3), generator=torch.Generator().manual_seed(6))


def _calls(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every way of calling the T5 (no grad)."""
    with torch.no_grad():
        return {
            "generate": model.generate(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_length=6,
                                       num_beams=1, do_sample=False),
            "encoder": model.get_encoder()(input_ids=IDS).last_hidden_state,
            "decoder": model.get_decoder()(input_ids=DEC,
                                           encoder_hidden_states=torch.ones(2, 7, 32)).last_hidden_state,
            "shared": model.shared(IDS),
            "forward": model(input_ids=IDS, decoder_input_ids=DEC).logits,
        }


def _encoder_step(model: nn.Module, opt: Any, ids: torch.Tensor, backward: Any) -> float:
    """A loss computed from the encoder called on its own, then one optimizer step."""
    loss = model.get_encoder()(input_ids=ids).last_hidden_state.pow(2).mean()
    backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


@dataclass(frozen=True, slots=True)
class Direct:
    """One process of a sharded run: BERT's tied embeddings still one parameter, its embeddings
    not a unit of their own, its logits; T5's tied embeddings still one parameter, every call of
    `_calls`, the parameter elements held after them and before (W.held_elements), the loss of the
    step through the encoder, the gathered weights after it."""

    bert_tied: bool
    bert_embeddings_unit: bool
    bert_logits: torch.Tensor
    t5_tied: bool
    calls: dict[str, torch.Tensor]
    held_after: tuple[int, int]
    loss: float
    state: dict[str, torch.Tensor]


Runs = dict[tuple[str, str], list[Direct]]  # each config's processes


@dataclass(frozen=True, slots=True)
class Reference:
    """One plain process: BERT's logits, T5's calls, the encoder step's loss and weights after it."""

    bert_logits: torch.Tensor
    calls: dict[str, torch.Tensor]
    loss: float
    state: dict[str, torch.Tensor]


def _run(backend: str, strategy: str, folder: str) -> Direct:
    from torch.distributed.fsdp import FSDPModule

    import shardwise

    engine = shardwise.Engine(strategy=strategy, backend=backend, cpu=True)
    mlm = engine.prepare(bert())
    inner = engine.unwrap_model(mlm)
    bert_tied = inner.bert.embeddings.word_embeddings.weight is inner.cls.predictions.decoder.weight
    bert_embeddings_unit = isinstance(inner.bert.embeddings, FSDPModule)
    with torch.no_grad():
        bert_logits = mlm(input_ids=IDS).logits
    model = t5()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = engine.prepare(model, opt)
    inner = engine.unwrap_model(model)
    t5_tied = inner.encoder.embed_tokens.weight is inner.shared.weight
    rest = W.held_elements(inner)
    calls = _calls(inner)
    held_after = (W.held_elements(inner), rest)
    mine = IDS[engine.process_index:engine.process_index + 1]
    loss = _encoder_step(inner, opt, mine, engine.backward)
    state = engine.get_state_dict(model)
    # transformers' last line, on every process: gathered once, written by the main process
    inner.save_pretrained(f"{folder}/{backend}-{strategy}", is_main_process=engine.is_main_process)
    return Direct(bert_tied, bert_embeddings_unit, bert_logits, t5_tied, calls, held_after, loss, state)


def _reference() -> Reference:
    mlm = bert()
    with torch.no_grad():
        bert_logits = mlm(input_ids=IDS).logits
    model = t5()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = _calls(model)
    loss = _encoder_step(model, opt, IDS, torch.Tensor.backward)  # the mean over both processes' rows
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reference(bert_logits, calls, loss, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def runs(saved: Path) -> Runs:
    return {config: spawn(_run, 2, *config, str(saved), timeout=600) for config in CONFIGS}


@pytest.fixture(scope="module")
def reference() -> Reference:
    return _reference()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_tied_parameters_stay_one_parameter_in_one_unit(runs: Runs, reference: Reference,
                                                        config: tuple[str, str]) -> None:
    for rank in runs[config]:
        assert rank.bert_tied and rank.t5_tied
        assert not rank.bert_embeddings_unit  # left to the root with its tied twin
        torch.testing.assert_close(rank.bert_logits, reference.bert_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_generate_get_encoder_get_decoder_and_a_lone_submodule(runs: Runs,
                                                               reference: Reference,
                                                               config: tuple[str, str]) -> None:
    want = reference.calls
    for rank in runs[config]:
        got = rank.calls
        assert torch.equal(got["generate"], want["generate"])
        for name in ("encoder", "decoder", "shared", "forward"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
        held, rest = rank.held_after
        assert held == rest, "a direct call left parameters gathered"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_a_training_step_through_a_directly_called_encoder(runs: Runs, reference: Reference,
                                                           config: tuple[str, str]) -> None:
    ranks = runs[config]
    assert sum(r.loss for r in ranks) / 2 == pytest.approx(reference.loss, rel=1e-5)
    state = ranks[0].state
    assert state.keys() == reference.state.keys()
    for name, value in reference.state.items():
        torch.testing.assert_close(state[name], value, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_save_pretrained_on_every_process_writes_the_whole_model_once(runs: Runs, saved: Path,
                                                                       config: tuple[str, str]) -> None:
    """The engine's side of transformers' every-process `save_pretrained`: the folder holds the
    trained weights (the tied head written once, as transformers writes it) and reloads."""
    from safetensors import safe_open
    from transformers import T5ForConditionalGeneration

    folder = saved / "-".join(config)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "shared.weight" in keys
    reloaded = T5ForConditionalGeneration.from_pretrained(str(folder)).state_dict()
    for name, value in runs[config][0].state.items():
        assert torch.equal(reloaded[name], value), name
