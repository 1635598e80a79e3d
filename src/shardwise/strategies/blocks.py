"""Which submodules are a model's blocks (the units FSDP shards and checkpointing recomputes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError


def find_blocks(model: nn.Module, wrap: Sequence[str | type] = ()) -> list[nn.Module]:
    """The submodules to shard as units, in module order.

    With `wrap` given, every submodule whose class (or class name) is listed; none matching is
    an error. Otherwise the model's own hint (`transformers`' `_no_split_modules`), else the
    children of every ModuleList/Sequential that repeats one class at least twice.
    """
    if wrap:
        names = {w for w in wrap if isinstance(w, str)}
        classes = tuple(w for w in wrap if isinstance(w, type))
        blocks = [
            m
            for m in model.modules()
            if m is not model and (type(m).__name__ in names or (classes and isinstance(m, classes)))
        ]
        if not blocks:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"wrap={[getattr(w, '__name__', w) for w in wrap]} matches no submodule of "
                f"{type(model).__name__}; its module classes are: {', '.join(found)}"
            )
        return blocks
    hinted = set(getattr(model, "_no_split_modules", None) or ())
    found_hinted = [m for m in model.modules() if m is not model and type(m).__name__ in hinted]
    if hinted and found_hinted:
        return found_hinted
    # A stack of layers: a container whose children are all one *composite* class (a block
    # with submodules of its own, not a Linear), repeated; the outermost such stack wins, so
    # an MLP's Sequential(Linear, GELU, Linear) inside a block is never split further.
    stacked: list[nn.Module] = []
    inside: set[int] = set()
    for container in model.modules():
        if id(container) in inside or container is model:
            continue
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            kids = list(container.children())
            if (
                len(kids) >= 2
                and len({type(k) for k in kids}) == 1
                and any(True for _ in kids[0].children())
                and any(True for _ in kids[0].parameters())
            ):
                stacked.extend(kids)
                inside.update(id(m) for k in kids for m in k.modules())
    return stacked


_CHECKPOINTED = "_shardwise_checkpointed"  # set on a block whose forward is already wrapped


def apply_activation_checkpointing(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's forward during backward instead of keeping its activations.

    The block's own `forward` is wrapped (its module tree and parameter names are unchanged),
    so under FSDP the recompute runs while the unit's parameters are gathered for backward.
    """
    if not blocks:
        raise ConfigError(
            "activation_checkpointing=True found no blocks to checkpoint; name them with wrap=(...)"
        )
    for block in blocks:
        if getattr(block, _CHECKPOINTED, False):
            continue
        forward = block.forward

        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
        setattr(block, _CHECKPOINTED, True)
