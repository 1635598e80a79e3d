"""Which submodules are a model's blocks (the units FSDP shards and checkpointing recomputes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..config.tree import ConfigError
from ..distributed.internals import view_base


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


def keep_ties_whole(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """`blocks` without those holding a parameter that is also used outside them (tied weights:
    BERT's word embeddings and its masked-LM decoder, T5's shared embedding and its encoder's and
    decoder's `embed_tokens`, any model's `_tied_weights_keys`, all found by identity). Such a
    block is left to the unit above it, so each tied parameter lies in one sharding unit
    whatever the block list says (FSDP2 refuses a parameter managed by two)."""
    holders: dict[int, set[int]] = {}  # parameter -> the modules that hold it directly
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(m))
    kept = []
    for block in blocks:
        inside = {id(m) for m in block.modules()}
        if all(holders[id(p)] <= inside for p in block.parameters()):
            kept.append(block)
    return kept


_CHECKPOINTED = "_shardwise_checkpointed"  # the mode of a block whose forward is already wrapped
MODES = ("full", "selective", "offload")


def _saved_ops() -> list[Any]:
    """The operators whose outputs selective checkpointing keeps: matrix products and attention
    (expensive to recompute, and their outputs are small next to what surrounds them). These
    are the ops blocks dispatch after autograd's decompositions (`nn.Linear` and `transformers`'
    Conv1D: addmm/mm; attention: bmm/baddbmm or one fused scaled-dot-product op per device)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def _selective_context() -> Any:
    """torch's selective checkpointing: the `_saved_ops` outputs MUST_SAVE, the rest recomputed."""
    return create_selective_checkpoint_contexts(_saved_ops())


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: str = "full", *,
                                   every: int | None = None) -> None:
    """Trade compute (or host memory) for the activations each block keeps for backward.

    - `full`: the block keeps its inputs only and recomputes its forward during backward
      (non-reentrant `torch.utils.checkpoint`).
    - `selective`: torch's selective checkpointing keeps the outputs of matrix products and
      attention (`_saved_ops`) and recomputes the rest; with `every=k`, instead, blocks
      0, k, 2k, ... are checkpointed in full and the others keep everything.
    - `offload`: nothing is recomputed; every tensor the block saves for backward, except its
      own parameters and buffers, goes to host memory (pinned where CUDA is available) and is
      copied back when backward needs it (`OffloadActivations`).

    The block's own `forward` is wrapped (its module tree and parameter names are unchanged),
    so under FSDP the recompute runs while the unit's parameters are gathered for backward.
    Applying the same mode again changes nothing; another mode on a wrapped block is refused.
    """
    if mode not in MODES:
        raise ConfigError(f"activation_checkpointing={mode!r} is not a mode; choose one of: "
                          + ", ".join(MODES))
    if every is not None and (mode != "selective" or isinstance(every, bool) or every < 1):
        raise ConfigError(f"activation_checkpointing_every={every!r} needs activation_checkpointing="
                          "'selective' and an integer >= 1")
    if not blocks:
        raise ConfigError(
            f"activation_checkpointing={mode!r} found no blocks to checkpoint; name them with wrap=(...)"
        )
    for j, block in enumerate(blocks):
        done = getattr(block, _CHECKPOINTED, None)
        if done:
            if done != mode:
                raise ConfigError(f"{type(block).__name__} is already checkpointed as {done!r}; "
                                  f"activation_checkpointing={mode!r} cannot wrap it again")
            continue
        if every is not None and j % every:
            continue  # selective by layer: this block keeps all its activations
        wrap = _offloaded if mode == "offload" else _checkpointed
        context = _selective_context if mode == "selective" and every is None else None
        block.forward = wrap(block, block.forward, context)
        setattr(block, _CHECKPOINTED, mode)


def _checkpointed(block: nn.Module, forward: Callable[..., Any], context: Callable[[], Any] | None) -> Any:
    """`forward` under one non-reentrant `torch.utils.checkpoint` (selective with `context`);
    kept this simple so that `torch.compile` traces it whole."""
    kw: dict[str, Any] = {} if context is None else {"context_fn": context}

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kw, **kwargs)

    return checkpointed


def _offloaded(block: nn.Module, forward: Callable[..., Any], _context: Any) -> Any:
    """`forward` with the tensors it saves for backward kept in host memory."""

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with OffloadActivations(block):
            return forward(*args, **kwargs)

    return offloaded


def to_host(t: torch.Tensor, pin: bool) -> Any:
    """A saved device tensor's host copy (pinned: the copy is asynchronous on the stream, which
    orders it before any reuse of the device memory); a host tensor stays as it is."""
    if t.device.type == "cpu":
        return t
    if not pin or t.layout != torch.strided:
        return (t.device, t.to("cpu"))
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return (t.device, host)


def to_device(packed: Any, pin: bool) -> torch.Tensor:
    """The tensor `to_host` packed, back on its device for backward."""
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return cast(torch.Tensor, host.to(device, non_blocking=pin))


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """`torch.autograd.graph.save_on_cpu` for one block, except for the block's own parameters
    and buffers: those stay where they are. Copying a gathered FSDP parameter to the host would
    hold a host copy of every block's full weights (the sharding undone) and a second device
    copy in backward, while FSDP gathers it again for backward anyway.

    `pin_memory` defaults to whether CUDA is available (pinned copies are asynchronous). The
    copies go through the module-level `to_host`/`to_device`, which the planner's trace replaces
    to count them as host memory."""

    def __init__(self, block: nn.Module, pin_memory: bool | None = None) -> None:
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # the block's tensors as its forward sees them (FSDP2 swaps in the gathered parameters)
        own = {id(t) for t in (*block.parameters(), *block.buffers())}

        def pack(t: torch.Tensor) -> Any:
            if id(t) in own or id(view_base(t)) in own:
                return t
            return to_host(t, pin)

        def unpack(packed: Any) -> torch.Tensor:
            return to_device(packed, pin)

        super().__init__(pack, unpack)
