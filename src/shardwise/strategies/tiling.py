"""Tiled MLP and tiled loss (DeepSpeed's ALST): at long sequences the largest activations are a
block's MLP intermediate (batch x sequence x intermediate) and the logits (batch x sequence x
vocabulary, upcast to fp32 for the loss). Both are computed here over `tile_tokens` tokens at a
time, each tile recomputed in backward (`torch.utils.checkpoint`), so neither exists for the
whole sequence. Both are exact: the MLP and the head work token by token, and the loss is the
sum over tiles divided by the tokens, as transformers divides it.

A step of `strategies.steps`, after context parallelism (whose split sequences they tile) and
before activation checkpointing; each replaces an instance's `forward` only (module tree,
parameter names and checkpoints stay as they are).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..config.tree import BlocksConfig, ConfigError
from .blocks import find_blocks

log = logging.getLogger("shardwise")
_TILED = "_shardwise_tiled"  # marks a forward this module put on an instance


def tiling_step(model: nn.Module, cfg: BlocksConfig, *, context_parallel: bool) -> None:
    """Tile `model`'s MLPs and loss as `cfg` says (None: on under context parallelism)."""
    mlp = context_parallel if cfg.tiled_mlp is None else cfg.tiled_mlp
    loss = context_parallel if cfg.tiled_loss is None else cfg.tiled_loss
    if mlp:
        tiled = tile_mlps(model, cfg.wrap, cfg.tile_tokens)
        if not tiled and cfg.tiled_mlp:
            raise ConfigError("tiled_mlp: true, but no block of this model has an `mlp` to tile (a "
                              "transformers decoder block's); set tiled_mlp to false")
    if loss:
        if not is_causal_lm(model):
            if cfg.tiled_loss:
                name = type(model).__name__
                raise ConfigError(f"tiled_loss: true, but {name} is not a transformers causal LM (an output "
                                  "embedding and a `logits_to_keep` argument); set tiled_loss to false")
            return
        tile_loss(model, cfg.tile_tokens)


def _tiles(x: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    return list(x.split(tokens, dim=1))


def tile_mlps(model: nn.Module, wrap: tuple[Any, ...], tokens: int) -> int:
    """Give each block's `mlp` a forward over `tokens` tokens at a time; returns how many. A
    mixture of experts' block is left whole: its router routes (and records its logits for the
    load-balancing loss) once per forward, over every token."""
    count = 0
    for block in find_blocks(model, wrap):
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module) or getattr(mlp.forward, _TILED, False):
            continue
        if any(hasattr(m, "num_experts") for m in mlp.modules()):
            continue
        mlp.__dict__["forward"] = _tiled_mlp(mlp.forward, tokens)
        count += 1
    return count


def _tiled_mlp(forward: Callable[..., torch.Tensor], tokens: int) -> Callable[..., torch.Tensor]:
    def tiled(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or x.dim() != 3 or x.shape[1] <= tokens:
            return forward(x, *args, **kwargs)
        outs = [checkpoint(forward, tile, use_reentrant=False) if torch.is_grad_enabled() else forward(tile)
                for tile in _tiles(x, tokens)]
        return torch.cat(outs, dim=1)

    setattr(tiled, _TILED, True)
    return tiled


def is_causal_lm(model: nn.Module) -> bool:
    import inspect

    head = getattr(model, "get_output_embeddings", None)
    if not callable(head) or head() is None:
        return False
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# a causal LM config's changes to its logits after the head: honoured (the final softcap) or refused
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
NO_LOGITS = ("tiled_loss: a forward with labels never makes the logits (its loss is computed a tile of "
             "tokens at a time); set tiled_loss: false to read outputs.logits, or call the model without "
             "labels")


def tile_loss(model: nn.Module, tokens: int) -> None:
    """A forward with labels that computes the head and the cross entropy per tile of `tokens`
    tokens (the logits of the whole sequence never exist: reading the output's `logits` is refused
    in one line, `NO_LOGITS`). The model's final logit softcapping is applied per tile, and a
    mixture of experts' load-balancing loss is added as the model adds it."""
    forward = model.forward
    if getattr(forward, _TILED, False):
        return
    head = model.get_output_embeddings()  # type: ignore[operator]
    config = getattr(model, "config", None)
    for key in _LOGIT_SCALES:
        if getattr(config, key, None) not in (None, 1, 1.0):
            raise ConfigError(f"tiled_loss: {type(model).__name__}'s config scales its logits ({key}="
                              f"{getattr(config, key)!r}), which the tiled loss does not; set tiled_loss to "
                              "false")
    cap = getattr(config, "final_logit_softcapping", None)

    def tiled(*args: Any, **kwargs: Any) -> Any:
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is None and shift is None:
            return forward(*args, **kwargs)
        kwargs = dict(kwargs)
        kwargs.pop("labels", None)
        kwargs.pop("shift_labels", None)
        items = kwargs.pop("num_items_in_batch", None)
        ignore = kwargs.pop("ignore_index", -100)
        if shift is None:  # transformers' shift: tokens < n predict n
            assert labels is not None
            shift = F.pad(labels[..., 1:], (0, 1), value=ignore)
        none = torch.empty(0, dtype=torch.long)  # (the head runs on no token inside the model)
        asked = kwargs.pop("output_hidden_states", None)
        out = forward(*args, logits_to_keep=none, output_hidden_states=True, **kwargs)
        hidden = out.hidden_states[-1]
        if not asked:
            out.hidden_states = None
        total = sum((_tile_loss_sum(head, h, y, ignore, cap) for h, y in
                     zip(_tiles(hidden, tokens), _tiles(shift.to(hidden.device), tokens), strict=True)),
                    hidden.new_zeros((), dtype=torch.float32))
        count = (shift != ignore).sum() if items is None else items
        loss = total / (count.to(total.device) if isinstance(count, torch.Tensor) else count)
        aux = out.get("aux_loss")
        if isinstance(aux, torch.Tensor):  # (a mixture of experts' router loss, as the model adds it)
            loss = loss + float(getattr(model, "router_aux_loss_coef")) * aux.to(loss.dtype)  # noqa: B009
        return without_logits(out, loss)

    setattr(tiled, _TILED, True)
    model.__dict__["forward"] = tiled
    log.info("prepare: the loss of %s is computed over %d tokens at a time (tiled_loss: a forward with "
             "labels makes no logits)",
             type(model).__name__, tokens)


class NoLogits:
    """What a tiled loss's output holds for `logits`: any use of it (an attribute, an index, a
    torch function) is refused in one line (`NO_LOGITS`); `is None` checks see something there,
    and torch's pytree and FSDP see a leaf that is not a tensor."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (protocol lookups, e.g. copy's and pickle's, find nothing)
            raise AttributeError(name)
        raise AttributeError(NO_LOGITS)

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(NO_LOGITS)

    def __iter__(self) -> Any:
        raise TypeError(NO_LOGITS)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(NO_LOGITS)

    def __repr__(self) -> str:
        return "NoLogits(tiled_loss)"


def without_logits(out: Any, loss: torch.Tensor) -> Any:
    """`out` (a transformers ModelOutput) with `loss` first and `NoLogits` for its logits."""
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, logits=NoLogits(), **fields)


def _tile_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore: int,
                   cap: float | None) -> torch.Tensor:
    def part(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        if cap is not None:  # (Gemma 2's final softcapping, as its forward applies it)
            logits = torch.tanh(logits / cap) * cap
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=ignore,
                               reduction="sum")

    if not torch.is_grad_enabled():
        return part(hidden, labels)
    return checkpoint(part, hidden, labels, use_reentrant=False)  # type: ignore[no-any-return]
