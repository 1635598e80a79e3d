"""Models to plan for: named presets, a local `config.json`, `module:factory`, or a built module.

Each becomes a `ModelSpec`: how to build the model at a chosen depth (inside the fake-tensor
mode, so nothing is allocated), how to make a batch of any size, how to compute the loss, the
depth of its repeated stack and the longest sequence it accepts. Presets are `transformers`
models built from their configs (no download), sized like the published checkpoints.

Depth: a model whose blocks sit in one stack deeper than `MIN_EXTRAPOLATED_DEPTH` is traced cut
to 3 and 4 blocks and extrapolated (see `fit.py`); any other model is traced whole.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .candidate import PlanError as PlanError  # re-exported: defined beside `Candidate`, which uses it
from .fakes import current_fake_mode, fake_copy, tree_leaves, tree_map
from .trace import default_loss

TRACE_DEPTHS = (3, 4)
MIN_EXTRAPOLATED_DEPTH = 5


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the planner can trace at any depth and batch size."""

    name: str
    build: Callable[[int | None], nn.Module]
    """depth of the repeated stack (None: as published) -> the model; called in the fake mode"""
    make_batch: Callable[[int], Any]
    """per-device batch size -> one batch as the training loop passes it to the model"""
    depth: int | None
    """blocks in the repeated stack when it can be extrapolated, else None (traced whole)"""
    loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss
    """(model output, batch) -> the loss"""
    max_seq: int | None = None
    """the longest sequence the model accepts (positions), when it has a limit"""
    seq_len: int | None = None
    """the sequence length batches are made with"""


# name -> (transformers config class, head class, config keywords, task)
_GPT2 = {"vocab_size": 50257, "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
_LLAMA = {"vocab_size": 32000, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
PRESETS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, n_embd=768, n_layer=12, n_head=12), "causal"),
    "gpt2-medium": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, n_embd=1024, n_layer=24, n_head=16),
                    "causal"),
    "gpt2-large": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, n_embd=1280, n_layer=36, n_head=20),
                   "causal"),
    "gpt2-xl": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, n_embd=1600, n_layer=48, n_head=25), "causal"),
    "deberta-v2-xlarge": (
        "DebertaV2Config", "DebertaV2ForSequenceClassification",
        {"vocab_size": 128100, "hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 24,
             "intermediate_size": 6144, "max_position_embeddings": 512, "type_vocab_size": 0, "num_labels": 2,
             "relative_attention": True, "position_buckets": 256, "pos_att_type": ["p2c", "c2p"],
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "classify",
    ),
    "blenderbot-400m": (  # BlenderBot-400M-distill's shape: 2 encoder and 12 decoder layers
        "BlenderbotConfig", "BlenderbotForConditionalGeneration",
        {"vocab_size": 8008, "d_model": 1280, "encoder_layers": 2, "decoder_layers": 12,
             "encoder_attention_heads": 32, "decoder_attention_heads": 32, "encoder_ffn_dim": 5120,
             "decoder_ffn_dim": 5120, "max_position_embeddings": 128, "dropout": 0.0,
             "attention_dropout": 0.0, "activation_dropout": 0.0, "decoder_start_token_id": 1},
        "seq2seq",
    ),
    "llama-1b": (  # TinyLlama-1.1B's shape: grouped-query attention, SwiGLU, RMSNorm, RoPE
        "LlamaConfig", "LlamaForCausalLM",
        dict(_LLAMA, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, max_position_embeddings=2048),
        "causal",
    ),
    "llama-7b": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, max_position_embeddings=4096),
        "causal",
    ),
}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_SEQ2SEQ_LAYER_KEYS = ("encoder_layers", "decoder_layers")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:  # pragma: no cover - transformers is a test dependency
        raise PlanError("planning a transformers model needs `pip install transformers`") from None
    return transformers


def _max_positions(cfg: Any) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _task_of(cfg: Any, arch: str) -> str:
    if getattr(cfg, "is_encoder_decoder", False):
        return "seq2seq"
    if "SequenceClassification" in arch:
        return "classify"
    return "causal"


def _hf_batch(task: str, seq_len: int, vocab: int) -> Callable[[int], Any]:
    def make(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        if task == "classify":
            return {"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long)}
        return {"input_ids": ids, "labels": torch.zeros(batch, seq_len, dtype=torch.long)}

    return make


def _depth_key(cfg: Any) -> tuple[str | None, int | None]:
    """The config key of the one stack deep enough to extrapolate, and its depth."""
    keys = _SEQ2SEQ_LAYER_KEYS if getattr(cfg, "is_encoder_decoder", False) else _LAYER_KEYS[:1]
    deep = [(k, getattr(cfg, k)) for k in keys if isinstance(getattr(cfg, k, None), int)]
    deep = [(k, v) for k, v in deep if v >= MIN_EXTRAPOLATED_DEPTH]
    return deep[0] if len(deep) == 1 else (None, None)


def hf_spec(name: str, cfg: Any, arch: str, seq_len: int) -> ModelSpec:
    """A `transformers` model from its config: built from the config class, at any depth."""
    tf = _transformers()
    limit = _max_positions(cfg)
    if seq_len < 1:
        raise PlanError(f"--seq-len {seq_len}: must be at least 1")
    if limit is not None and seq_len > limit:
        raise PlanError(f"--seq-len {seq_len} is longer than {name} allows ({limit} positions)")
    model_cls = getattr(tf, arch, None)
    if model_cls is None:
        raise PlanError(f"{name}: transformers has no model class {arch!r}")
    key, depth = _depth_key(cfg)
    task = _task_of(cfg, arch)

    def build(layers: int | None) -> nn.Module:
        c = copy.deepcopy(cfg)
        if layers is not None and key is not None:
            setattr(c, key, layers)
        return cast(nn.Module, model_cls(c))

    return ModelSpec(name=name, build=build, make_batch=_hf_batch(task, seq_len, cfg.vocab_size), depth=depth,
                     max_seq=limit, seq_len=seq_len)


def preset_spec(name: str, seq_len: int) -> ModelSpec:
    """A named preset (see `PRESETS`)."""
    if name not in PRESETS:
        raise PlanError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}; or a config.json path, "
                        "or module:factory")
    cfg_name, arch, kwargs, _task = PRESETS[name]
    cfg = getattr(_transformers(), cfg_name)(**kwargs)
    return hf_spec(name, cfg, arch, seq_len)


def config_json_spec(path: str | Path, seq_len: int) -> ModelSpec:
    """A local `config.json` (or a folder holding one) of a `transformers` model."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"{path}: no such config.json")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise PlanError(f"{p}:{err.lineno}: JSON syntax error: {err.msg}") from None
    archs = data.get("architectures") or []
    model_type = data.get("model_type")
    if not archs or not model_type:
        raise PlanError(f"{p}: needs 'model_type' and 'architectures' to know which model to build")
    tf = _transformers()
    try:
        cfg = tf.AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
    except (ValueError, KeyError) as err:
        raise PlanError(f"{p}: {err}") from None
    return hf_spec(str(p), cfg, archs[0], seq_len)


def factory_spec(target: str, seq_len: int) -> ModelSpec:
    """`package.module:function`: the function returns a module, or (module, make_batch) where
    make_batch(batch_size, seq_len) returns one batch. A `transformers` model needs no make_batch."""
    mod_name, _, fn_name = target.partition(":")
    if not mod_name or not fn_name:
        raise PlanError(f"model {target!r}: expected module:factory")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise PlanError(f"model {target!r}: {err}") from None

    def made() -> tuple[nn.Module, Callable[[int], Any] | None]:
        out = factory()
        model, make = (out if isinstance(out, tuple) else (out, None))
        if not isinstance(model, nn.Module):
            raise PlanError(f"{target} returned {type(model).__name__}, not a torch.nn.Module")
        return model, (None if make is None else (lambda b: make(b, seq_len)))

    def make_batch(batch: int) -> Any:
        model, make = made()
        if make is not None:
            return make(batch)
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "vocab_size"):
            raise PlanError(f"{target}: return (model, make_batch) so the planner can make inputs")
        return _hf_batch(_task_of(cfg, type(model).__name__), seq_len, cfg.vocab_size)(batch)

    return ModelSpec(name=target, build=lambda layers: made()[0], make_batch=make_batch, depth=None,
                     seq_len=seq_len)


def resolve_model(model: str, seq_len: int) -> ModelSpec:
    """What `shardwise plan --model X` means: a preset, a config.json path, or module:factory."""
    if model in PRESETS:
        return preset_spec(model, seq_len)
    if model.endswith(".json") or Path(model).is_dir():
        return config_json_spec(model, seq_len)
    if ":" in model and not Path(model).exists():
        return factory_spec(model, seq_len)
    return preset_spec(model, seq_len)  # raises, listing the presets


# -- a module the user already built (Engine(strategy="auto")) --------------------------------
def module_spec(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    wrap: tuple[Any, ...] = (),
) -> ModelSpec:
    """A built module (real tensors, never copied) and one batch of it at any batch size.

    The trace works on a structural copy with fake parameters. When its blocks sit in one stack
    deeper than `MIN_EXTRAPOLATED_DEPTH`, copies cut to a few blocks are traced and extrapolated;
    a `transformers` config in the copy is told the new depth too.
    """
    from ..strategies import find_blocks

    if any(getattr(m, "_shardwise_checkpointed", False) for m in model.modules()):
        raise PlanError("plan the model before activation checkpointing is applied to it")
    blocks = find_blocks(model, wrap)
    parents = _stack_parents(model, blocks)
    depth = len(blocks) if len(parents) == 1 and len(blocks) >= MIN_EXTRAPOLATED_DEPTH else None
    dim0 = batch_dim(sample_batch)

    def build(layers: int | None) -> nn.Module:
        clone = fake_copy(model, current_fake_mode())
        if layers is not None and depth is not None:
            _cut_stack(clone, layers, depth)
        return clone

    def make_batch(batch: int) -> Any:
        return _resize_batch(sample_batch, dim0, batch)

    return ModelSpec(name=type(model).__name__, build=build, make_batch=make_batch, depth=depth,
                     loss_fn=loss_fn or default_loss)


def _stack_parents(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    ids = {id(b) for b in blocks}
    parents: list[tuple[nn.Module, str]] = []
    for mod in model.modules():
        for name, child in mod.named_children():
            if (id(child) in ids and isinstance(mod, (nn.ModuleList, nn.Sequential))
                    and (not parents or parents[-1][0] is not mod)):
                parents.append((mod, name))
    return parents


def _cut_stack(model: nn.Module, layers: int, depth: int) -> None:
    """Keep the first `layers` blocks of the model's one deep stack, in place."""
    from ..strategies import find_blocks

    for parent_name, parent in model.named_modules():
        kids = list(parent.children()) if isinstance(parent, (nn.ModuleList, nn.Sequential)) else []
        if len(kids) == depth and {id(k) for k in kids} <= {id(b) for b in find_blocks(model)}:
            owner_name, _, attr = parent_name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, attr, type(parent)(kids[:layers]))
            cfg = getattr(model, "config", None)
            for key in _LAYER_KEYS:
                if getattr(cfg, key, None) == depth:
                    setattr(cfg, key, layers)
            return
    raise PlanError(f"could not cut {type(model).__name__} to {layers} blocks")


def batch_dim(sample: Any) -> int:
    """The batch size of a sample batch: the most common first dimension of its tensors."""
    sizes = [t.shape[0] for t in _tensors(sample) if t.dim() > 0]
    if not sizes:
        raise PlanError("the sample batch holds no tensor with a batch dimension")
    return max(set(sizes), key=sizes.count)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _resize_batch(sample: Any, dim0: int, batch: int) -> Any:
    """The sample with every tensor whose first dimension is the batch made `batch` long
    (fresh tensors of the same dtype; inside the fake mode they cost nothing)."""
    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        shape = (batch, *x.shape[1:]) if x.dim() > 0 and x.shape[0] == dim0 else tuple(x.shape)
        return torch.zeros(shape, dtype=x.dtype)

    return tree_map(one, sample)
