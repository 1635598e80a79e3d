"""Context parallelism, a step on the `cp` view of the mesh (`strategies.steps`): each sequence is
split along its length over the ranks of a context group, which take the same samples.

The loop stays as it is. The step gives a transformers model:
- **a split at the model's door** (a forward pre-hook on the prepared model): the batch the model
  is called with (`input_ids`, `labels`, `attention_mask`, `position_ids` made if missing,
  `inputs_embeds`, `token_type_ids`) is cut along the sequence, each rank keeping its share
  (contiguous for Ulysses, zigzag for the ring, `strategies.attention`). The labels are shifted
  first (`shift_labels`), so no token's target is lost at a cut, and the mask's facts (padding,
  packed documents) are kept for the whole sequence;
- **its attention** through transformers' attention registry (`AttentionInterface`): no model code
  is copied; the model's attention implementation (`set_attn_implementation`) names ours, which
  runs Ulysses or the ring;
- **the whole sequence's outputs** on every rank of the group (`whole_output`): each rank's cross
  entropy is summed over its tokens and divided by the tokens of the whole sequence
  (transformers' `num_items_in_batch`), then summed over the group by a differentiable
  all-reduce. So `model(**batch).loss`, `engine.backward(loss)`, a logged loss and
  `engine.reduce(loss, "mean")` are one process's. The other outputs users read are the whole
  sequence's too, in sequence order: the logits and hidden states (gathered over the group,
  differentiable), a mixture of experts' router logits, and its load-balancing loss computed from
  the whole sequence's routing (in the loss too), as one process computes it.
What the split cannot give exactly is refused in one line at prepare (`check_model`): a model
that is not a causal LM (a classifier pools the whole sequence), attention options this version
does not split (logit softcapping, chunked or bidirectional attention); a sliding window is
honoured.
The data-parallel step then shards over data x context ranks (the `fsdp` view), as torchtitan does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..config.tree import ConfigError
from ..distributed.mesh import ParallelDims
from ..weights.adapters import is_peft_model
from .attention import (
    Split,
    contiguous_index,
    gather_over,
    ring_attention,
    sum_over,
    ulysses_attention,
    zigzag_index,
)
from .tiling import is_causal_lm

log = logging.getLogger("shardwise")

METHODS = ("ring", "ulysses")
SPLIT_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids", "inputs_embeds",
              "token_type_ids")
_ATTR = "_shardwise_context"  # on every submodule of a prepared model: its `ContextParallel`
# a model config's attention options the split does not honour: attribute -> what it changes
REFUSED_OPTIONS = {"attn_logit_softcapping": "attention-logit softcapping",
                   "attention_chunk_size": "chunked attention",
                   "use_bidirectional_attention": "bidirectional attention"}
# what transformers hands an attention function besides q, k, v and the mask: read here
# (`scaling`, `dropout`, `sliding_window`), or facts of the forward that do not change attention
_ATTENTION_KEYS = {"scaling", "dropout", "sliding_window", "position_ids", "use_cache", "output_attentions",
                   "output_hidden_states", "output_router_logits", "num_items_in_batch", "shift_labels",
                   "cache_position", "is_causal", "ignore_index", "token_type_ids"}


class ContextParallel:
    """One prepared model's context parallelism: its group, its method, the current batch's split."""

    def __init__(self, group: dist.ProcessGroup, size: int, method: str, config: Any) -> None:
        self.group, self.size, self.method, self.config = group, size, method, config
        self.rank = dist.get_rank(group)
        self.split: Split | None = None

    def cut(self, seq: int) -> tuple[torch.Tensor, ...]:
        parts = 2 * self.size if self.method == "ring" else self.size
        if seq % parts:
            raise ValueError(f"context_parallel_size={self.size} ({self.method}): a sequence of {seq} tokens "
                             f"cannot be cut into {parts} equal chunks; pad the sequences to a multiple of "
                             f"{parts} (e.g. the collator's pad_to_multiple_of={parts})")
        return zigzag_index(seq, self.size) if self.method == "ring" else contiguous_index(seq, self.size)

    def split_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments this rank's model forward takes: the batch cut along its sequence."""
        kwargs = dict(kwargs)
        if kwargs.get("return_dict") is False:
            raise ValueError("context parallelism reads the model's outputs by name (the whole sequence's "
                             "loss and logits); call the model without return_dict=False")
        if any(kwargs.get(k) is not None for k in ("past_key_values", "cache", "cache_position")):
            raise ValueError("context parallelism splits whole sequences (training and evaluation "
                             "forwards); a forward with a key/value cache (generate) is not split: generate "
                             "with a model prepared without context_parallel_size")
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise ValueError("context parallelism: call the model with keyword arguments "
                                 "(model(input_ids=..., labels=..., ...)) so each can be split along the "
                                 "sequence")
            kwargs["input_ids"] = args[0]
        ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not isinstance(ref, torch.Tensor):
            raise ValueError(  # noqa: TRY004 -- a missing argument, not a wrong type
                "context parallelism: the model was called without input_ids or "
                             "inputs_embeds")
        batch, seq = ref.shape[:2]
        index = self.cut(seq)
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        # transformers' packed sequences: documents restart their position ids in one row, each
        # attending only within itself, where no attention mask is given and no cache is made
        # (use_cache off: with the default on, one process masks causally across documents)
        cached = kwargs.get("use_cache", getattr(self.config, "use_cache", False))
        packed = positions is not None and mask is None and not cached
        if positions is None:
            positions = torch.arange(seq, device=ref.device).expand(batch, seq)
        positions = kwargs["position_ids"] = positions.expand(batch, seq)
        kwargs["use_cache"] = False  # (a training forward: no cache of this rank's keys and values)
        valid = torch.ones(batch, seq, dtype=torch.bool, device=ref.device) if mask is None else mask.bool()
        doc = torch.zeros(batch, seq, dtype=torch.long, device=ref.device)
        if packed:
            diff = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
            doc = (diff != 1).cumsum(-1)
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and kwargs.get("shift_labels") is None:
            kwargs["shift_labels"] = F.pad(labels[..., 1:], (0, 1), value=-100)
        if isinstance(labels, torch.Tensor) and kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = (kwargs["shift_labels"] != -100).sum()
        kwargs.pop("attention_mask", None)  # (kept in the split: the model must not build its own)
        mine = index[self.rank].to(ref.device)
        for key in SPLIT_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq:
                kwargs[key] = value.index_select(1, mine)
        self.split = Split(tuple(i.to(ref.device) for i in index), valid, doc,
                           causal_only=mask is None and not packed,
                           chunk=seq // (2 * self.size) if self.method == "ring" else 0)
        return kwargs

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the whole sequence on every rank of the group (differentiable)."""
        return sum_over(loss, self.group)

    def whole_output(self, model: nn.Module, output: Any) -> Any:
        """The model's output as one process gives it for the whole sequence (see the module's
        text): the loss summed over the group, the router's load-balancing loss of the whole
        sequence's routing, and the per-token outputs gathered in sequence order."""
        if not callable(getattr(output, "items", None)) or self.split is None:
            return output
        fields = dict(output.items())
        loss, aux, router = fields.get("loss"), fields.get("aux_loss"), fields.get("router_logits")
        whole_aux, coef = None, 0.0
        if isinstance(aux, torch.Tensor) and isinstance(router, tuple):
            experts, top_k, coef = router_settings(model)
            whole_aux = self.whole_router_loss(router, experts, top_k)
            fields["aux_loss"] = whole_aux
        if isinstance(loss, torch.Tensor):
            if isinstance(aux, torch.Tensor) and whole_aux is not None:  # (the model added its own
                loss = loss - coef * aux.to(loss.dtype)  # tokens' share: the whole one instead)
            loss = self.whole_loss(loss)
            fields["loss"] = loss if whole_aux is None else loss + coef * whole_aux.to(loss.dtype)
        for key in ("logits", "last_hidden_state"):
            if isinstance(fields.get(key), torch.Tensor):
                fields[key] = self.gather(fields[key])
        for key in ("hidden_states", "router_logits"):
            if isinstance(fields.get(key), tuple):
                fields[key] = tuple(self.gather(t) if isinstance(t, torch.Tensor) else t for t in fields[key])
        return type(output)(**fields)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's per-token tensor ([B, S/N, ...], or a router's [B * S/N, E]) made the whole
        sequence's, in sequence order, on every rank of the group (differentiable)."""
        assert self.split is not None
        batch, mine = self.split.valid.shape[0], len(self.split.index[self.rank])
        flat = x.dim() == 2 and x.shape[0] == batch * mine
        if flat:
            x = x.reshape(batch, mine, x.shape[-1])
        if x.dim() < 2 or x.shape[0] != batch or x.shape[1] != mine:
            return x
        every = gather_over(x, self.group)
        order = torch.argsort(torch.cat(self.split.index)).to(x.device)
        if not flat:
            return every.index_select(1, order)
        rows = (torch.arange(batch, device=x.device)[:, None] * len(order) + order).reshape(-1)
        return every.reshape(-1, every.shape[-1]).index_select(0, rows)  # (a new tensor, not a view)

    def whole_router_loss(self, router: tuple[torch.Tensor, ...], experts: int, top_k: int) -> torch.Tensor:
        """transformers' `load_balancing_loss_func` over the whole sequence: the count of top-k
        assignments and the sum of routing probabilities per expert, and the number of tokens
        (padding left out where the batch has an attention mask, as one process does), summed
        over the group, then combined (differentiable through the probabilities)."""
        assert self.split is not None
        valid = self.split.valid[:, self.split.index[self.rank].to(self.split.valid.device)]
        weight = valid.reshape(-1).to(router[0].device, torch.float32)
        tokens = torch.zeros(experts, dtype=torch.float32, device=router[0].device)
        probs = torch.zeros_like(tokens)
        for layer in router:
            routing = torch.softmax(layer.float(), dim=-1)
            chosen = torch.topk(routing, top_k, dim=-1).indices
            tokens = tokens + torch.zeros_like(tokens).scatter_add_(0, chosen.reshape(-1),
                                                                     weight.repeat_interleave(top_k))
            probs = probs + (routing * weight[:, None]).sum(0)
        rows = weight.sum() * len(router)
        total = sum_over(torch.cat([tokens, probs, rows[None]]), self.group)
        tokens, probs, rows = total[:experts], total[experts:2 * experts], total[-1]
        return torch.sum((tokens / rows) * (probs / rows)) * experts

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float | None, window: int | None) -> torch.Tensor:
        if self.split is None:
            raise RuntimeError("context parallelism: attention ran before the model's forward split "
                               "the batch")
        if not getattr(module, "is_causal", True):
            raise ValueError(f"context parallelism: {type(module).__name__} is not causal; this "
                             "version splits causal (decoder) attention only")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        fn = ring_attention if self.method == "ring" else ulysses_attention
        return fn(query, key, value, self.split, self.group, scale, window)


def router_settings(model: nn.Module) -> tuple[int, int, float]:
    """A transformers mixture of experts' number of experts, experts per token and the weight of
    its load-balancing loss in the loss (refused in one line where the model does not say them)."""
    names = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    values = [getattr(model, n, None) for n in names]
    if not all(isinstance(v, (int, float)) for v in values):
        raise ValueError(f"context parallelism: {type(model).__name__} returns a router's load-balancing "
                         f"loss but does not say its {', '.join(names)}, from which the whole sequence's "
                         "loss is computed; set output_router_logits=False")
    return int(values[0]), int(values[1]), float(values[2])  # type: ignore[arg-type]


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: [B, H, S, D] in, ([B, S, H, D], None) out."""
    cp = module.__dict__.get(_ATTR)
    if cp is None:
        raise RuntimeError(f"attn_implementation {IMPLEMENTATION!r} is shardwise's context-parallel "
                           "attention: it runs only in a model prepared with context_parallel_size > 1")
    if dropout and module.training:
        raise ValueError("context parallelism: attention dropout is not split exactly; set the model's "
                         "attention_dropout to 0")
    unread = sorted(k for k, v in kwargs.items()
                    if k not in _ATTENTION_KEYS and v is not None and v is not False)
    if unread:  # (before this layer's collectives, alike on every rank)
        raise ValueError(f"context parallelism: {type(module).__name__} asks its attention for "
                         f"{', '.join(f'{k}={kwargs[k]!r}' for k in unread)}, which this version does not "
                         "split; set context_parallel_size to 1 for this model")
    window = kwargs.get("sliding_window")
    if "sliding_window" not in kwargs and getattr(cp.config, "sliding_window", None) is not None:
        raise ValueError(f"context parallelism: {type(module).__name__}'s config sets sliding_window="
                         f"{cp.config.sliding_window} but its attention does not say its window; set "
                         "context_parallel_size to 1 for this model")
    out = cp.attention(module, query, key, value, scaling, window)
    return out.transpose(1, 2).contiguous(), None


IMPLEMENTATION = "shardwise_context_parallel"


def attention_of(config: Any) -> str | None:
    """The attention implementation a transformers config names (transformers keeps it under a
    private name, read here only)."""
    return getattr(config, "_attn_implementation", None)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPLEMENTATION, _attention)
    # no 4-D mask is built for it: the split keeps the mask's facts for the whole sequence
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, lambda *a, **k: None)


def check_model(model: nn.Module, cp: int) -> None:
    """Refuse in one line a transformers model whose outputs or attention the split cannot give
    as one process does (see the module's text)."""
    config = getattr(model, "config", None)
    base = model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]
    name = type(base).__name__
    if not is_causal_lm(base):
        raise ConfigError(f"context_parallel_size={cp}: {name} is not a causal LM (an output embedding "
                          "and transformers' logits_to_keep): a head that reads the whole sequence (a "
                          "classifier pools one token of it) cannot be split along it; set "
                          "context_parallel_size to 1 for this model")
    for key, what in REFUSED_OPTIONS.items():
        value = getattr(config, key, None)
        if value is not None and value is not False:
            raise ConfigError(f"context_parallel_size={cp}: {name}'s config sets {key}={value!r} ({what}), "
                              f"which this version does not split; set {key} to None in the model's config, "
                              "or context_parallel_size to 1")


def context_parallel_step(model: nn.Module, dims: ParallelDims, method: str) -> ContextParallel | None:
    """Split `model`'s sequences over its context group (see the module's text); refused in one
    line where it cannot be done exactly."""
    if dims.cp == 1:
        return None
    config = getattr(model, "config", None)
    setter = getattr(model, "set_attn_implementation", None)
    if config is None or not callable(setter):
        raise ConfigError(f"context_parallel_size={dims.cp}: {type(model).__name__} is not a transformers "
                          "model, whose attention shardwise replaces through transformers' attention "
                          "registry; set context_parallel_size to 1 for this model")
    check_model(model, dims.cp)
    heads = getattr(config, "num_attention_heads", None)
    if method == "ulysses":
        local = heads // dims.tp if isinstance(heads, int) else None
        if local is None or local % dims.cp:
            split_by = f"/ tp {dims.tp} " if dims.tp > 1 else ""
            raise ConfigError(f"context_parallel: ulysses splits the attention heads: {heads} heads "
                              f"{split_by}do not divide by context_parallel_size={dims.cp}; choose a size "
                              "that divides them, or context_parallel: ring")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ConfigError(f"context_parallel_size={dims.cp}: attention_dropout="
                          f"{config.attention_dropout} is not split exactly; set it to 0")
    _register()
    rank = dist.get_rank()
    cp = ContextParallel(dims.get_mesh("cp").get_group(), dims.cp, method, config)
    was = attention_of(config)
    setter(IMPLEMENTATION)  # (the model and its sub-models; transformers checks it is registered)
    if attention_of(config) != IMPLEMENTATION:
        raise ConfigError(f"context_parallel_size={dims.cp}: {type(model).__name__} does not take its "
                          "attention from transformers' attention registry (its attention is its own "
                          "code), so it cannot be split; set context_parallel_size to 1 for this model")
    for m in model.modules():
        m.__dict__[_ATTR] = cp
    model.register_forward_pre_hook(lambda _m, a, k: ((), cp.split_inputs(a, k)), with_kwargs=True)
    model.register_forward_hook(lambda m, _a, out: cp.whole_output(m, out))
    log.info("prepare: context parallelism %s over %d ranks (rank %d holds part %d); attention %s -> %s",
             method, dims.cp, rank, cp.rank, was, IMPLEMENTATION)
    return cp
