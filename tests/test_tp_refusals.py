"""What tensor and sequence parallelism refuse, through the Engine a user builds, at 2 processes.

Each case is the user's own call (`shardwise.Engine(...)` and `engine.prepare(model)`) with one
thing tensor parallelism cannot take: a model without a plan, a plan pattern naming no module,
key/value heads tp does not divide, a split dimension tp does not divide, a tp that does not
divide the world, zero3 with tp on DeepSpeed; sequence parallelism without tp, on DeepSpeed, on a
block whose q/k/v hang off the block itself (the project's GPT) and on a block holding whole
parameters that are not norms; a colwise layer without a rowwise partner, a 2-output head planned
colwise (it trained on half its outputs), and under sequence parallelism an MLP run on pooled
(batch, hidden) states and a sequence tp does not divide: refused at `prepare(model, loader)` (a
trial forward on the meta device with the loader's first samples, before the model is changed),
and at the first forward where no DataLoader is prepared with the model. Asserted: every process
refuses, with the same message, exactly one line (`workloads.one_line`), that starts with the
words the case expects. (The node-crossing tp and the odd sequence are refused in
tests/unit/test_unit_tensor_parallel.py and tests/test_sequence_parallel.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

NO_ERROR = "no error"


def _kv_heads_1() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=W.VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                                        max_position_embeddings=W.SEQ))


class _Sub(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _PooledBlock(nn.Module):
    """A block whose MLP runs on the pooled (batch, hidden) states: no sequence dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = _Sub(), _Sub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return self.mlp(x.mean(1))


class _Pooled(nn.Module):
    tensor_parallel_plan: ClassVar[dict[str, str]] = {
                            "blocks.*.attn.up": "colwise", "blocks.*.attn.down": "rowwise",
                            "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_PooledBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _two_output_head() -> nn.Module:
    """A classifier of 2 outputs: a Llama-like body whose head a user planned colwise."""
    torch.manual_seed(0)
    return nn.Sequential(_Sub(), nn.Linear(8, 2))


def _gated_llama() -> nn.Module:
    llama = W.build("llama")
    llama.model.layers[0].register_parameter("gate", nn.Parameter(llama.model.norm.weight.detach().clone()))
    return llama


# case -> (Engine keywords besides cpu and seed, the model prepared (None: the Engine refuses),
#          the message's start)
CASES: dict[str, tuple[dict[str, Any], Callable[[], nn.Module] | None, str]] = {
    "no plan": ({"strategy": "zero3", "tensor_parallel_size": 2}, lambda: W.build("tiny"),
                "ConfigError: tensor_parallel_size=2: TinyLM has no tensor-parallel plan"),
    "a pattern naming nothing": (
        {"strategy": "zero3", "tensor_parallel_size": 2,
         "tensor_parallel_plan": {"layers.*.mlp.up": "colwise"}},
        lambda: W.build("llama"),
        "ConfigError: tensor_parallel_plan: 'layers.*.mlp.up' names no module of LlamaForCausalLM"),
    "heads not divisible": ({"strategy": "zero3", "tensor_parallel_size": 2}, _kv_heads_1,
                            "ConfigError: tensor_parallel_size=2 does not divide LlamaForCausalLM's "
                            "num_key_value_heads=1"),
    "a split dimension not divisible": (
        {"strategy": "zero2", "tensor_parallel_size": 2, "tensor_parallel_plan": {"0": "colwise"}},
        lambda: nn.Sequential(nn.Linear(6, 9)),
        "ConfigError: tensor_parallel_size=2 does not divide 0's (9, 6) weight (colwise: dimension 0)"),
    "tp not dividing the world": ({"strategy": "zero3", "tensor_parallel_size": 4}, None,
                                  "ConfigError: tensor_parallel_size=4 does not divide the 2 processes"),
    "zero3 with tp on deepspeed": ({"strategy": "zero3", "tensor_parallel_size": 2, "backend": "deepspeed"},
                                   None, "ConfigError: tensor_parallel_size=2 with backend: deepspeed and "
                                   "strategy: zero3: DeepSpeed trains AutoTP only up to ZeRO-2"),
    "sp without tp": ({"strategy": "zero3", "sequence_parallel": True}, None,
                      "ConfigError: sequence_parallel: true splits the activations over the tensor-parallel"),
    "sp on deepspeed": ({"strategy": "zero2", "tensor_parallel_size": 2, "sequence_parallel": True,
                         "backend": "deepspeed"}, None,
                        "ConfigError: sequence_parallel: true with backend: deepspeed: DeepSpeed's AutoTP "
                        "has no sequence parallelism; use backend: torch"),
    "sp, q/k/v off the block": ({"strategy": "zero3", "tensor_parallel_size": 2, "sequence_parallel": True},
                                lambda: W.build("gpt"), "ConfigError: sequence_parallel: each block's "
                                "attention and MLP must be modules of their own"),
    "colwise without a rowwise partner": (
        {"strategy": "zero2", "tensor_parallel_size": 2,
         "tensor_parallel_plan": {"model.layers.*.mlp.up_proj": "colwise",
                                  "model.layers.*.mlp.gate_proj": "colwise"}},
        lambda: W.build("llama"),
        "ConfigError: tensor_parallel_plan: model.layers.0.mlp.up_proj is colwise (its output stays split "
        "over the tp ranks) but model.layers.0.mlp has no rowwise layer to take it"),
    "a 2-output head planned colwise": (
        {"strategy": "zero2", "tensor_parallel_size": 2, "tensor_parallel_plan": {"0.up": "colwise",
                                                                                 "0.down": "rowwise",
                                                                                 "1": "colwise"}},
        _two_output_head,
        "ConfigError: tensor_parallel_plan: 1 is colwise (its output stays split over the tp ranks) but the "
        "model (1 is not inside a sublayer) has no rowwise layer"),
    "sp, an MLP without a sequence dimension (at prepare, with its DataLoader)": (
        {"strategy": "zero3", "tensor_parallel_size": 2, "sequence_parallel": True}, _Pooled,
        "ConfigError: sequence_parallel: blocks.0.mlp gets hidden states of shape (2, 8), with no sequence "
        "dimension"),
    "sp, an MLP without a sequence dimension (at the first forward, no DataLoader)": (
        {"strategy": "zero3", "tensor_parallel_size": 2, "sequence_parallel": True}, _Pooled,
        "ConfigError: sequence_parallel: blocks.0.mlp gets hidden states of shape (2, 8), with no sequence "
        "dimension"),
    "sp, a sequence tp does not divide (at prepare, with its DataLoader)": (
        {"strategy": "zero3", "tensor_parallel_size": 2, "sequence_parallel": True}, lambda: W.build("llama"),
        "ConfigError: sequence_parallel: the sequence length 7 does not divide by tensor_parallel_size=2"),
    "sp, whole parameters in a block": (
        {"strategy": "zero3", "tensor_parallel_size": 2, "sequence_parallel": True}, _gated_llama,
        "ConfigError: sequence_parallel: model.layers.0 (LlamaDecoderLayer) holds whole parameters"),
}


def _loader(case: str) -> DataLoader[Any]:
    """The case's DataLoader: pooled (batch, 4, 8) inputs, or token ids of an odd length 7."""
    if "sequence tp does not divide" in case:
        return DataLoader(TensorDataset(torch.randint(0, W.VOCAB, (8, 7))), batch_size=2)
    return DataLoader(TensorDataset(torch.randn(8, 4, 8), torch.randn(8, 8)), batch_size=2, shuffle=True)


def _refusals(cases: list[str]) -> dict[str, str]:
    """Each case's `Engine(...)` (and `prepare(model)`): what it raised, as "Type: message"."""
    import shardwise

    out: dict[str, str] = {}
    for case in cases:
        settings, model, _ = CASES[case]
        engine = None
        try:
            engine = shardwise.Engine(cpu=True, seed=W.SEED, **settings)
            if model is not None and "at prepare" in case:
                built = model()
                try:  # refused before the model is changed, the loader's samples read, not drawn
                    engine.prepare(built, _loader(case))
                finally:
                    assert not any(isinstance(p, DTensor) for p in built.parameters()), "split before refused"
            elif model is not None:
                prepared = engine.prepare(model())
                if "first forward" in case:
                    prepared(torch.randn(2, 4, 8))
            out[case] = NO_ERROR
        except Exception as err:  # noqa: BLE001 - the message is the result
            out[case] = f"{type(err).__name__}: {err}"
        if engine is not None:
            engine.free_memory()
    return out


def check_refusals(ranks: list[dict[str, str]], cases: list[str]) -> None:
    """Every case refused on every process, the same one line, starting with its words."""
    for case in cases:
        said = [rank[case] for rank in ranks]
        assert said[0] != NO_ERROR, f"{case}: not refused"
        W.one_line(said[0])
        assert said[0].startswith(CASES[case][2]), \
            f"{case}: {said[0]!r} does not start with {CASES[case][2]!r}"
        assert all(s == said[0] for s in said), (case, said)


def test_tensor_and_sequence_parallel_refusals_through_the_engine_are_one_line() -> None:
    cases = list(CASES)
    ranks = spawn(_refusals, 2, cases)
    for case in cases:
        print(f"{case}: {ranks[0][case]}")
    check_refusals(ranks, cases)


# -- planted faults (tests/planted.py) ------------------------------------------------------------
def test_planted_no_plan_not_refused_is_caught() -> None:
    """`no_plan_not_refused`: a model without a plan trains unsplit; the check finds no refusal."""
    cases = ["no plan"]
    caught(check_refusals, spawn(planted(_refusals, "no_plan_not_refused"), 2, cases), cases,
           must=r"^no plan: not refused")


def test_planted_refusal_two_lines_is_caught() -> None:
    """`refusal_two_lines`: sequence parallelism's refusal of a block it cannot cut gains a second
    line (a hint); `pytest.raises(match=)` would still pass, the one-line check does not."""
    cases = ["sp, q/k/v off the block"]
    caught(check_refusals, spawn(planted(_refusals, "refusal_two_lines"), 2, cases), cases,
           must=r"^not one line: \"ConfigError: sequence_parallel: each block's attention and MLP "
                r".*\\n  see ")  # (the repr's \n: a second line)


def test_planted_sequence_trial_skipped_is_caught() -> None:
    """`sequence_trial_skipped`: prepare does not run its trial forward; the MLP without a
    sequence dimension is not refused at prepare (the check finds no refusal)."""
    cases = ["sp, an MLP without a sequence dimension (at prepare, with its DataLoader)"]
    caught(check_refusals, spawn(planted(_refusals, "sequence_trial_skipped"), 2, cases), cases,
           must=r"\(at prepare, with its DataLoader\): 'AssertionError: split before refused' does not start "
                r"with 'ConfigError: sequence_parallel: blocks\.0\.mlp gets hidden states")
