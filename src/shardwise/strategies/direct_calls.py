"""A sharded model's submodules called on their own, and its `generate`, on FSDP2.

FSDP2 gathers a unit's parameters in the unit's own forward hooks. The root unit holds what no
block holds (embeddings, final norms, heads), and its hooks run only when the root's `forward`
does. transformers calls into a model other ways: `generate` of an encoder-decoder calls
`get_encoder()(...)` and then the decoder directly, and users call `model.get_encoder()`, or
`model.bert(...)`, themselves; the root's shared embedding is then still a shard, and the first
op that meets it fails (`aten.embedding.default got mixed torch.Tensor and DTensor`).

`route_direct_calls` fixes that where it happens:
- `generate` (a transformers or peft model's) runs as a forward of the root
  (`register_fsdp_forward_method`): the root's parameters are gathered once for the whole
  generation; the blocks gather per forward as in training.
- Every submodule that holds root parameters (in its subtree, outside any inner unit) has its
  `forward` wrapped (an instance attribute; the module tree and its names are unchanged). When
  neither the root's forward, nor `generate`, nor another such call is running, the call runs
  as a forward of the root: gathered first, resharded after (FSDP2's own pre/post-forward, so
  a training call gets its backward hooks too), and under no_grad every unit is resharded after
  it, as after the root's own evaluation forward. Inside the root's forward the wrapper only
  checks a counter. In a backward (an activation checkpoint recomputing a block) it runs the
  call as it is: that call is the recompute of a forward of the root, not a direct call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from ..distributed.internals import in_backward

_ENTRY = "_shardwise_entry"  # the root's forward method that runs one direct call
_ROUTED = "_shardwise_routed"  # on the root: its `_Depth`; on a submodule: its forward is wrapped


class _Depth:
    """How many forwards of the root (its own, `generate`, routed calls) are running."""

    def __init__(self) -> None:
        self.n = 0

    def enter(self, *_: Any) -> None:
        self.n += 1

    def leave(self, *_: Any) -> None:
        self.n -= 1


def root_held(root: nn.Module) -> set[int]:
    """Ids of the parameters the root unit itself holds (none of its inner units does)."""
    inner = [m for m in root.modules() if m is not root and isinstance(m, FSDPModule)]
    in_units = {id(p) for u in inner for p in u.parameters()}
    return {id(p) for p in root.parameters() if id(p) not in in_units}


def _entries(root: nn.Module, held: set[int]) -> list[nn.Module]:
    """Submodules outside every inner unit whose subtree holds a root parameter."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, FSDPModule):
                continue  # a unit gathers its own parameters in its own hooks
            if any(id(p) in held for p in child.parameters()):
                out.append(child)
                visit(child)

    visit(root)
    return out


Run = Callable[..., Any]  # (fn, *args, **kwargs) -> fn(*args, **kwargs), as a forward of the root


def route_direct_calls(root: nn.Module, entries: list[nn.Module], run: Run,
                       after: Callable[[], None]) -> None:
    """Wrap each of `entries`' forward: called while no forward of `root` runs, it runs through
    `run` (the backend's forward of the root around it), then `after` (a no-grad call's cleanup).
    A no-op when called again on the same root."""
    if hasattr(root, _ROUTED):
        return
    depth = _Depth()
    root.__dict__[_ROUTED] = depth
    root.register_forward_pre_hook(depth.enter, prepend=True)
    root.register_forward_hook(depth.leave, always_call=True)
    for module in entries:
        if not getattr(module, _ROUTED, False):
            module.__dict__["forward"] = _routed(module.forward, depth, run, after)
            module.__dict__[_ROUTED] = True


def route_fsdp_calls(root: nn.Module, reshard: Callable[[], None]) -> None:
    """`route_direct_calls` for an FSDP2 root: the submodules that hold root parameters run as a
    forward of the root (FSDP2's pre/post-forward: gathered, then resharded, with backward
    hooks for a training call); after a no-grad call every unit is back to its shard."""
    if not isinstance(root, FSDPModule) or hasattr(root, _ROUTED):
        return

    def entry(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    root.__dict__[_ENTRY] = entry
    register_fsdp_forward_method(root, _ENTRY)
    route_direct_calls(root, _entries(root, root_held(root)), getattr(root, _ENTRY),
                       lambda: None if torch.is_grad_enabled() else reshard())


def _routed(forward: Callable[..., Any], depth: _Depth, run: Run,
            after: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        if depth.n or in_backward():
            # inside a forward of the root (or generate), or an activation checkpoint's recompute
            # in the backward (the root's forward ran; the backend's backward hooks hold what it
            # gathers, and a release here would leave a partitioned weight to take a full
            # gradient): nothing to add
            return forward(*args, **kwargs)
        depth.enter()
        try:
            return run(forward, *args, **kwargs)
        finally:
            depth.leave()
            after()

    return call


def generate_as_forward(root: nn.Module) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the root's `generate` as an FSDP forward method, counted as a root forward;
    returns a wrapper `sync_generate` puts around the result."""
    depth: _Depth | None = getattr(root, _ROUTED, None)
    if isinstance(root, FSDPModule) and callable(getattr(root, "generate", None)):
        register_fsdp_forward_method(root, "generate")

    def counted(generate: Callable[..., Any]) -> Callable[..., Any]:
        if depth is None:
            return generate

        @functools.wraps(generate)
        def run(*args: Any, **kwargs: Any) -> Any:
            depth.enter()
            try:
                return generate(*args, **kwargs)
            finally:
                depth.leave()

        return run

    return counted
