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
        if not _is_causal_lm(model):
            if cfg.tiled_loss:
                name = type(model).__name__
                raise ConfigError(f"tiled_loss: true, but {name} is not a transformers causal LM (an output "
                                  "embedding and a `logits_to_keep` argument); set tiled_loss to false")
            return
        tile_loss(model, cfg.tile_tokens)


def _tiles(x: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    return list(x.split(tokens, dim=1))


def tile_mlps(model: nn.Module, wrap: tuple[Any, ...], tokens: int) -> int:
    """Give each block's `mlp` a forward over `tokens` tokens at a time; returns how many."""
    count = 0
    for block in find_blocks(model, wrap):
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module) or getattr(mlp.forward, _TILED, False):
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


def _is_causal_lm(model: nn.Module) -> bool:
    import inspect

    head = getattr(model, "get_output_embeddings", None)
    if not callable(head) or head() is None:
        return False
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def tile_loss(model: nn.Module, tokens: int) -> None:
    """A forward with labels that computes the head and the cross entropy per tile of `tokens`
    tokens (the logits of the whole sequence never exist: the output's `logits` is None)."""
    forward = model.forward
    if getattr(forward, _TILED, False):
        return
    head = model.get_output_embeddings()  # type: ignore[operator]

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
        total = sum((_tile_loss_sum(head, h, y, ignore) for h, y in
                     zip(_tiles(hidden, tokens), _tiles(shift.to(hidden.device), tokens), strict=True)),
                    hidden.new_zeros((), dtype=torch.float32))
        count = (shift != ignore).sum() if items is None else items
        out.loss = total / (count.to(total.device) if isinstance(count, torch.Tensor) else count)
        out.logits = None
        return out

    setattr(tiled, _TILED, True)
    model.__dict__["forward"] = tiled
    log.info("prepare: the loss of %s is computed over %d tokens at a time (tiled_loss: its logits are None)",
             type(model).__name__, tokens)


def _tile_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore: int) -> torch.Tensor:
    def part(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=ignore,
                               reduction="sum")

    if not torch.is_grad_enabled():
        return part(hidden, labels)
    return checkpoint(part, hidden, labels, use_reentrant=False)  # type: ignore[no-any-return]
