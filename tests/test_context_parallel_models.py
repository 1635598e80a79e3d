"""Context parallelism where users look: other model families and the outputs they read, each
against one plain process (fp32), at 2 processes (cp 2, zero3), 3 AdamW steps at lr 1e-2 on the
64-token batches of `test_context_parallel` (left-padded where the mask matters):

  families      Mistral (a sliding window of 16 tokens over 64), Gemma 2 (sliding and full layers
                alternating, final logit softcapping at 30, its attention-logit softcapping off),
                Mixtral with the router's load-balancing loss on (the whole sequence's routing,
                padding left out as one process leaves it out), a Llama with peft's LoRA
                adapters (left-padded, Ulysses), each under the ring (tiled loss)
                and Ulysses (the model's own loss): losses and clipped norms within 1e-5, weights
                within 5e-5 or three times the fp32 floor (one fp32 process against fp64).
  outputs       an evaluation forward without labels under no_grad: `outputs.logits` and the hidden
                states are the whole sequence's, in sequence order, on every rank (the next-token
                prediction `logits[:, -1]` of every row is one process's); a loop that computes
                its own loss from `outputs.logits` (no labels) trains as one process does; with the
                tiled loss, `outputs[0]` is the loss and reading the logits is refused in one line;
                the router's `aux_loss` is the whole sequence's.
  refusals      one line each, at prepare or before the first collective: a sequence classifier
                (it pools one token of the whole sequence), Gemma 2's attention-logit softcapping,
                `return_dict=False`, a DataLoader split already by a DistributedSampler; and the
                data-parallel size said at prepare (a loader sized by the processes' count).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from test_context_parallel import BATCH, LR, SEQ, STEPS, VOCAB, Batches
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

LOSS_TOL, WEIGHT_TOL = 1e-5, 5e-5
FAMILIES = [("mistral", "left", "ring"), ("mistral", "left", "ulysses"), ("gemma2", "left", "ring"),
            ("gemma2", "left", "ulysses"), ("mixtral", "left", "ring"), ("mixtral", "left", "ulysses"),
            ("mixtral", "plain", "ring"), ("lora", "left", "ulysses")]


def build(family: str, attention: str = "sdpa") -> nn.Module:
    import transformers as T

    torch.manual_seed(1234)
    common: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "max_position_embeddings": SEQ, "tie_word_embeddings": False}
    if family == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**common))
    elif family == "lora":  # (peft's LoRA on q and v, the base frozen)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(T.LlamaForCausalLM(T.LlamaConfig(**common)),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    elif family == "classifier":
        model = T.LlamaForSequenceClassification(T.LlamaConfig(num_labels=3, pad_token_id=0, **common))
    elif family == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(sliding_window=16, **common))
    elif family in ("gemma2", "gemma2_softcap"):
        softcap = 50.0 if family == "gemma2_softcap" else None
        config = T.Gemma2Config(head_dim=8, sliding_window=16, final_logit_softcapping=30.0,
                                attn_logit_softcapping=softcap, **common)
        model = T.Gemma2ForCausalLM(config)
    elif family == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                     output_router_logits=True, **common))
    else:
        raise ValueError(family)
    model.config._attn_implementation = attention
    return model


@functools.cache
def reference(family: str, kind: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One plain process on the same batches (BATCH samples a step)."""
    model = build(family).to(dtype)
    if dtype == torch.float64 and family == "mixtral":  # (torch's grouped matmul takes no fp64)
        model.set_experts_implementation("eager")
    return W.train_plain(model, DataLoader(Batches(BATCH * STEPS, kind), batch_size=BATCH), LR)


def _engine(method: str, **extra: Any) -> Any:
    import shardwise

    return shardwise.Engine(strategy="zero3", cpu=True, seed=0, context_parallel_size=2,
                            context_parallel=method, tile_tokens=8, **extra)


def _train(family: str, kind: str, method: str) -> dict[str, Any]:
    """The ring with the tiled loss (the default), Ulysses with the model's own loss."""
    engine = _engine(method, tiled_loss=method == "ring")
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = DataLoader(Batches(BATCH * STEPS, kind), batch_size=BATCH)
    model, opt, loader = engine.prepare(model, opt, data)
    losses, norms = [], []
    for batch in loader:
        loss = model(**batch).loss
        engine.backward(loss)
        norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = engine.get_state_dict(model)
    engine.free_memory()
    return {"losses": losses, "norms": norms, "state": state}


def _outputs(method: str, evaluation_only: bool = False) -> dict[str, Any]:
    """What a loop reads: an evaluation forward's outputs (alone: `evaluation_only`), a loss of
    its own from the logits, the tiled loss's output, a mixture of experts' aux loss."""
    out: dict[str, Any] = {}
    engine = _engine(method)
    model = build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = engine.prepare(model, opt)
    batches = list(DataLoader(Batches(BATCH * STEPS, "left"), batch_size=BATCH))
    with torch.no_grad():
        seen = model(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"],
                     output_hidden_states=True)
    out["logits"], out["hidden"] = seen.logits, [h.clone() for h in seen.hidden_states]
    if evaluation_only:
        engine.free_memory()
        return out
    tiled = model(**batches[0])
    out["first"] = torch.equal(tiled[0], tiled.loss)
    uses = {"attribute": lambda: tiled.logits.argmax(-1), "key": lambda: tiled["logits"][:, -1],
            "torch": lambda: F.softmax(tiled.logits, dim=-1)}
    for use, read in uses.items():
        try:
            read()
            out[use] = "(read)"
        except (AttributeError, KeyError, TypeError) as err:
            out[use] = str(err.args[0])
    losses = []
    for batch in batches:  # a loss of the loop's own, from the logits (no labels given to the model)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["own"], out["own_state"] = losses, engine.get_state_dict(model)
    engine.free_memory()
    engine = _engine(method, tiled_loss=False)  # (the logits of a forward with labels, as one process's)
    model = engine.prepare(build("llama"))
    with torch.no_grad():
        out["labelled"] = model(**batches[0]).logits
    engine.free_memory()
    engine = _engine(method)
    model = engine.prepare(build("mixtral"))
    with torch.no_grad():
        moe = model(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"])
    out["aux_loss"], out["router"] = moe.aux_loss, [r.clone() for r in moe.router_logits]
    engine.free_memory()
    return out


def _refusals() -> dict[str, str]:
    from shardwise.config.tree import ConfigError

    out: dict[str, str] = {}

    def refused(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "(accepted)"
        except (ConfigError, ValueError) as err:
            out[name] = str(err)

    refused("classifier", lambda: _engine("ring").prepare(build("classifier")))
    refused("softcap", lambda: _engine("ring").prepare(build("gemma2_softcap")))

    def tuple_output() -> None:
        model = _engine("ring").prepare(build("llama"))
        model(input_ids=torch.zeros(1, SEQ, dtype=torch.long), return_dict=False)

    refused("return_dict", tuple_output)
    split = DataLoader(Batches(8, "plain"), batch_size=2, sampler=DistributedSampler(Batches(8, "plain"),
                                                                                     num_replicas=2, rank=0))
    refused("sampler", lambda: _engine("ring").prepare(split))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardwise")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        engine = _engine("ring")
        engine.prepare(DataLoader(Batches(8, "plain"), batch_size=2))
        engine.free_memory()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["said"] = next((line for line in lines if "data-parallel rank(s)" in line), "(nothing said)")
    return out


def _all() -> dict[Any, Any]:
    out: dict[Any, Any] = {case: _train(*case) for case in FAMILIES}
    out["outputs", "ring"], out["outputs", "ulysses"] = _outputs("ring"), _outputs("ulysses")
    out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[Any, Any]]:
    return spawn(_all, 2)


def _floor(family: str, kind: str) -> float:
    """The fp32 noise floor of the final weights: how far one fp32 process ends from the same run
    in fp64 (as test_context_parallel's)."""
    a, b = reference(family, kind), reference(family, kind, torch.float64)
    return max((a["state"][k] - b["state"][k].float()).abs().max().item() for k in a["state"])


def check_trained(runs: list[dict[Any, Any]], case: tuple[str, str, str]) -> None:
    ref = reference(*case[:2])
    for rank, res in enumerate(runs):
        run = res[case]
        assert run["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), (case, rank, run["losses"],
                                                                              ref["losses"])
        assert run["norms"] == pytest.approx(ref["norms"], abs=LOSS_TOL), (case, rank, run["norms"],
                                                                            ref["norms"])
    state = runs[0][case]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst <= max(WEIGHT_TOL, 3 * _floor(*case[:2])), (case, worst)


@pytest.mark.parametrize("case", FAMILIES, ids=["-".join(c) for c in FAMILIES])
def test_other_families_match_one_process(runs: list[dict[Any, Any]], case: tuple[str, str, str]) -> None:
    check_trained(runs, case)


def _plain_outputs() -> dict[str, Any]:
    model = build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = list(DataLoader(Batches(BATCH * STEPS, "left"), batch_size=BATCH))
    with torch.no_grad():
        seen = model(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"],
                     output_hidden_states=True)
    out: dict[str, Any] = {"logits": seen.logits, "hidden": list(seen.hidden_states)}
    losses = []
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["own"], out["own_state"] = losses, model.state_dict()
    moe = build("mixtral")
    with torch.no_grad():
        seen = moe(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"])
    out["aux_loss"], out["router"] = seen.aux_loss, list(seen.router_logits)
    return out


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_the_outputs_a_loop_reads_are_the_whole_sequences(runs: list[dict[Any, Any]], method: str) -> None:
    check_outputs(runs, method)


def test_outputs_left_local_are_caught() -> None:
    """`context_outputs_local`: the logits, hidden states and router logits left as each rank's
    share of the tokens (the loss alone whole)."""
    runs = spawn(planted(_planted_outputs, "context_outputs_local"), 2)
    caught(check_outputs, runs, "ulysses", must=r"\(0, torch.Size\(\[2, 32, 64\]\)\)")


def _planted_outputs() -> dict[Any, Any]:
    # (the real test's evaluation forward: with the logits left local, the loop's own loss that
    # follows would stop at a shape error, which is not a check's finding)
    return {("outputs", "ulysses"): _outputs("ulysses", evaluation_only=True)}


def check_outputs(runs: list[dict[Any, Any]], method: str) -> None:
    plain = _plain_outputs()
    for rank, res in enumerate(runs):
        out = res["outputs", method]
        assert out["logits"].shape == plain["logits"].shape, (rank, out["logits"].shape)
        torch.testing.assert_close(out["logits"], plain["logits"], rtol=0, atol=1e-5)
        assert torch.equal(out["logits"][:, -1].argmax(-1), plain["logits"][:, -1].argmax(-1))  # every row's
        torch.testing.assert_close(out["labelled"], plain["logits"], rtol=0, atol=1e-5)
        for mine, theirs in zip(out["hidden"], plain["hidden"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
        assert out["own"] == pytest.approx(plain["own"], abs=LOSS_TOL), (rank, out["own"], plain["own"])
        assert out["first"], "outputs[0] is not the loss"
        for read in ("attribute", "key", "torch"):
            assert out[read].startswith("tiled_loss: a forward with labels never makes the logits") \
                and "\n" not in out[read], (read, out[read])
        torch.testing.assert_close(out["aux_loss"], plain["aux_loss"], rtol=0, atol=1e-6)
        for mine, theirs in zip(out["router"], plain["router"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    state = runs[0]["outputs", method]["own_state"]
    worst = max((state[k] - v).abs().max().item() for k, v in plain["own_state"].items())
    assert worst <= max(WEIGHT_TOL, 3 * _floor("llama", "left")), worst


def test_what_the_split_cannot_give_is_refused_in_one_line(runs: list[dict[Any, Any]]) -> None:
    expected = {"classifier": r"LlamaForSequenceClassification is not a causal LM",
                "softcap": r"attn_logit_softcapping=50\.0 \(attention-logit softcapping\)",
                "return_dict": r"call the model without return_dict=False",
                "sampler": r"DistributedSampler over 2 replicas.*split twice",
                "said": r"context_parallel_size 2: the DataLoader is split over 1 data-parallel rank\(s\), "
                        r"not 2 processes"}
    for res in runs:
        for name, pattern in expected.items():
            said = res["refusals"][name]
            assert re.search(pattern, said) and "\n" not in said, (name, said)
