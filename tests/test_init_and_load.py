"""Issue 21, items 5 and 6: a model's own initialization and pretrained weights are never lost.

- init_empty + prepare equals a normal build bit for bit at 1, 2 and 4 processes: in
  test_big_models.py (`test_empty_init_equals_a_normal_build`, the models of this file included).
- An initialization shardwise cannot replay is refused in one line naming the parameter and the
  `init_weights()` fix, the same line on every process, before any sharding.
- Pretrained keys under a wrapper's prefix (`module.`, `_orig_mod.`, `_fsdp_wrapped_module.`,
  `model.`) load bit for bit through `from_pretrained` and `load_model`; keys under an unknown
  prefix are refused (strict), and load with `key_map`; a Llama's own `model.` stays.
- `model.load_state_dict(sd)` after `init_empty()` is kept by `prepare` (whole or partial).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch import nn


class OwnInit(nn.Module):
    """Initializes in its constructor the ways models do: a zeroed head, raw parameters, a
    padding row, trunc_normal_, orthogonal_, a scaled view, and a random buffer between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(W.VOCAB, 16, padding_idx=3)
        self.body = nn.Linear(16, 16)
        # drawn between parameters: the generator must keep step
        self.register_buffer("noise", torch.randn(16))
        self.head = nn.Linear(16, W.VOCAB)
        nn.init.zeros_(self.head.weight)
        self.scale = nn.Parameter(torch.ones(16))
        self.shift = nn.Parameter(torch.randn(16) * 0.1)
        self.gate = nn.Parameter(torch.empty(16, 16))
        nn.init.trunc_normal_(self.gate, std=0.02)
        self.rot = nn.Parameter(torch.empty(16, 16))
        nn.init.orthogonal_(self.rot)
        with torch.no_grad():
            self.body.weight.data[0].fill_(0.5)
            self.shift.mul_(2.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) @ self.gate @ self.rot
        return self.head(self.body(x) * self.scale + self.shift + self.noise)


class Derived(nn.Module):
    """`b` is computed from `a` (another meta tensor under init_empty): not replayable."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.empty(8, 8))
        with torch.no_grad():
            self.b.copy_(self.a.weight * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) @ self.b


class DerivedWithInitWeights(Derived):
    """The same, with torchtitan's convention: shardwise calls it."""

    def init_weights(self) -> None:
        nn.init.normal_(self.a.weight, std=0.02)
        nn.init.zeros_(self.a.bias)
        with torch.no_grad():
            self.b.copy_(self.a.weight * 2)


class NeverInitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


# -- pretrained folders ---------------------------------------------------------------------------
def _trained_gpt2() -> nn.Module:
    """A GPT-2 moved off its init, so loaded weights cannot pass for initialized ones."""
    model = W.build("gpt2")
    torch.manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


PREFIXED = {  # folder -> how its keys were renamed from transformers' own
    "ddp": lambda k: "module." + k,
    "compiled_ddp": lambda k: "module._orig_mod." + k,
    "fsdp1": lambda k: k.replace("transformer.h.0.", "transformer.h.0._fsdp_wrapped_module."),
    "lightning": lambda k: "model." + k,
}


def make_folders(root: Path) -> dict[str, Any]:
    """The GPT-2 saved by save_pretrained, copies of it under prefixes, a tiny Llama."""
    from safetensors.torch import load_file, save_file
    from test_big_models import tiny_llama

    model = _trained_gpt2()
    model.save_pretrained(root / "gpt2")
    saved = load_file(root / "gpt2" / "model.safetensors")
    folders = {}
    for name, rename in {**PREFIXED, "unknown": lambda k: "encoder." + k}.items():
        (root / name).mkdir()
        shutil.copy(root / "gpt2" / "config.json", root / name / "config.json")
        renamed = {rename(k): v for k, v in saved.items()}
        save_file(renamed, root / name / "model.safetensors", metadata={"format": "pt"})
        folders[name] = str(root / name)
    torch.manual_seed(5)
    llama = tiny_llama()
    llama.save_pretrained(root / "llama")
    assert any(k.startswith("model.") for k in load_file(root / "llama" / "model.safetensors"))
    return {"folders": folders, "gpt2": str(root / "gpt2"), "llama": str(root / "llama"),
            "saved": saved, "llama_saved": load_file(root / "llama" / "model.safetensors")}


def _refusal(fn: Any) -> str | None:
    from shardwise import ConfigError
    from shardwise.checkpoint.sharded import CheckpointError

    try:
        fn()
    except (ConfigError, CheckpointError) as err:
        return str(err)
    return None


def _runs(folders: dict[str, str], gpt2: str, llama: str) -> dict[str, Any]:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    # item 5: what cannot be replayed is refused by name; an init_weights() is called instead
    out = _cannot_replay(engine)
    torch.manual_seed(11)
    with engine.init_empty():
        model = DerivedWithInitWeights()
    out["init_weights"] = engine.get_state_dict(engine.prepare(model))
    # item 6: keys under a wrapper's prefix, through from_pretrained and load_model
    for name, path in folders.items():
        if name == "unknown":
            continue
        model = engine.prepare(engine.from_pretrained(GPT2LMHeadModel, path))
        out[f"from_pretrained:{name}"] = engine.get_state_dict(model)
        torch.manual_seed(5)
        model = engine.prepare(W.build("gpt2"))
        engine.load_model(model, path)
        out[f"load_model:{name}"] = engine.get_state_dict(model)
    out["refused:unknown"] = _refusal(
        lambda: engine.prepare(engine.from_pretrained(GPT2LMHeadModel, folders["unknown"]))
    )
    model = engine.prepare(W.build("gpt2"))
    out["refused:unknown load_model"] = _refusal(lambda: engine.load_model(model, folders["unknown"]))
    model = engine.prepare(
        engine.from_pretrained(GPT2LMHeadModel, folders["unknown"], key_map={"encoder.": ""})
    )
    out["key_map"] = engine.get_state_dict(model)
    out["llama"] = engine.get_state_dict(engine.prepare(engine.from_pretrained(LlamaForCausalLM, llama)))
    return {**out, **_after_empty(gpt2)}


def _cannot_replay(engine: Any = None) -> dict[str, Any]:
    """What each model init_empty cannot replay says at prepare (None: prepared)."""
    import shardwise

    engine = engine or shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    out: dict[str, Any] = {}
    for cls in (Derived, NeverInitialized):
        with engine.init_empty():
            model = cls()
        out[f"refused:{cls.__name__}"] = _refusal(lambda model=model: engine.prepare(model))
    return out


def _after_empty(gpt2: str) -> dict[str, Any]:
    """Item 6: load_state_dict after init_empty is kept, whole or in part, on replicas and shards."""
    from transformers import GPT2LMHeadModel

    import shardwise

    out: dict[str, Any] = {}
    sd = GPT2LMHeadModel.from_pretrained(gpt2).state_dict()
    for strategy in ("ddp", "zero3"):
        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED)
        with engine.init_empty():
            model = W.build("gpt2")
        model.load_state_dict(sd)
        out[f"load_state_dict:{strategy}"] = engine.get_state_dict(engine.prepare(model))
        torch.manual_seed(21)
        with engine.init_empty():
            model = W.build("gpt2")
        model.load_state_dict({k: v for k, v in sd.items() if k.startswith("transformer.h.0.")}, strict=False)
        out[f"partial:{strategy}"] = engine.get_state_dict(engine.prepare(model))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    made = make_folders(tmp_path_factory.mktemp("pretrained"))
    ranks = spawn(_runs, 2, made["folders"], made["gpt2"], made["llama"])
    return {"ranks": ranks, **made}


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in want if not torch.equal(got[k], want[k])]


def test_an_init_shardwise_cannot_replay_is_refused_by_name(runs: dict[str, Any]) -> None:
    check_cannot_replay(runs["ranks"])


def test_planted_uninitialised_accepted_is_caught() -> None:
    """`uninitialised_accepted`: a parameter nothing initializes is prepared as allocated; the
    check wants its one-line refusal."""
    caught(check_cannot_replay, spawn(planted(_cannot_replay, "uninitialised_accepted"), 2),
           must=r"^NeverInitialized: the refusal on each process: \[None, None\]")


def check_cannot_replay(ranks: list[dict[str, Any]]) -> None:
    for cls, needle in (("Derived", "Derived.b "), ("NeverInitialized", "NeverInitialized.w ")):
        lines = [r[f"refused:{cls}"] for r in ranks]
        assert lines[0] is not None and all(x == lines[0] for x in lines), \
            f"{cls}: the refusal on each process: {lines}"
        assert "\n" not in lines[0] and needle in lines[0] and "init_weights()" in lines[0], lines[0]


def test_init_weights_is_called_where_the_record_falls_short(runs: dict[str, Any]) -> None:
    torch.manual_seed(11)
    ref = DerivedWithInitWeights()
    torch.manual_seed(11)  # the generator as init_empty() found it
    ref.init_weights()
    got = runs["ranks"][0]["init_weights"]
    assert not _equal(got, ref.state_dict()) and torch.equal(got["b"], got["a.weight"] * 2)


@pytest.mark.parametrize("name", [*PREFIXED])
def test_keys_under_a_wrapper_prefix_load_bit_for_bit(runs: dict[str, Any], name: str) -> None:
    saved = runs["saved"]
    for way in ("from_pretrained", "load_model"):
        got = runs["ranks"][0][f"{way}:{name}"]
        assert not _equal(got, saved), (way, name, _equal(got, saved)[:3])
        assert torch.equal(got["lm_head.weight"], saved["transformer.wte.weight"])  # still tied


def test_an_unknown_prefix_is_refused_key_map_renames_it_and_a_llamas_own_prefix_stays(
    runs: dict[str, Any],
) -> None:
    for case in ("refused:unknown", "refused:unknown load_model"):
        lines = [r[case] for r in runs["ranks"]]
        assert lines[0] is not None and all(x == lines[0] for x in lines), lines
        for needle in ("unexpected encoder.", "key_map=", "strict=False"):
            assert needle in lines[0] and "\n" not in lines[0], (needle, lines[0])
    assert not _equal(runs["ranks"][0]["key_map"], runs["saved"])
    assert not _equal(runs["ranks"][0]["llama"], runs["llama_saved"])  # its keys start with model.: kept


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_load_state_dict_after_init_empty_is_kept(runs: dict[str, Any], strategy: str) -> None:
    check_kept(runs["ranks"][0], runs["gpt2"], strategy)


def test_values_loaded_into_an_empty_model_and_dropped_are_caught(runs: dict[str, Any]) -> None:
    out = spawn(planted(_after_empty, "loaded_into_meta_dropped"), 2, runs["gpt2"])[0]
    caught(check_kept, out, runs["gpt2"], "zero3",
           must=r"^zero3: loaded into an empty model, \d+ tensors unlike the file's: "
                r"\['transformer\.wte\.weight'")


def check_kept(out: dict[str, Any], gpt2: str, strategy: str) -> None:
    from transformers import GPT2LMHeadModel

    sd = GPT2LMHeadModel.from_pretrained(gpt2).state_dict()
    got = out[f"load_state_dict:{strategy}"]
    differ = _equal(got, sd)
    assert not differ, \
        f"{strategy}: loaded into an empty model, {len(differ)} tensors unlike the file's: {differ[:3]}"
    torch.manual_seed(21)
    fresh = W.build("gpt2").state_dict()  # what init_empty + prepare gives the keys not loaded
    partial = out[f"partial:{strategy}"]
    loaded = [k for k in sd if k.startswith("transformer.h.0.")]
    assert loaded and not _equal(partial, {k: sd[k] for k in loaded})
    assert not _equal(partial, {k: v for k, v in fresh.items() if k not in loaded})

