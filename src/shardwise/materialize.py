"""Models built without memory: parameters on the meta device, materialized shard by shard.

`init_empty()` builds a model whose parameters are on the meta device (no bytes, no random
draws) while its buffers stay real, so non-persistent buffers the model computes in its
constructor (rotary caches, position ids) come out exactly as in a normal build. A model built
under `torch.device("meta")` is accepted too; its buffers are then the initializers' job
(`transformers` models' `_init_weights` computes rotary caches).

At `prepare`, the strategy shards (or replicates) the empty model and `materialize` fills it:
module by module, every process builds the module's own parameters as full CPU tensors, runs
the model's own initializers on them (`reset_parameters`, and a `transformers` model's
`_init_weights`), and keeps only its slice (`write`). Every process draws the same numbers from
the same generator state, so the model does not depend on the world size or the strategy, no
two shards of a parameter are copies of each other (per-shard random init would make them so),
and no process ever holds more than its shards plus one module's full parameters.

Order and generator: plain modules are initialized in registration order (pre-order), with the
CPU generator set to its state when `init_empty()` was entered, which is what a normal build
draws for torch's own layers: on one process the weights are bit-identical to building the model
normally with the same seed. A `transformers` model runs each module's `reset_parameters` then
`_init_weights`, children first (transformers' own order); its draws are not those of a normal
`Model(config)` build (which draws torch's defaults first and then overwrites them), so those
weights are equal in distribution, not bit for bit. A module whose parameters no initializer
writes is refused by name.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import ConfigError

Writer = Callable[[torch.Tensor, torch.Tensor], None]  # (prepared tensor, full value) -> store its slice


@dataclass
class EmptyInit:
    """What `init_empty()` recorded: the CPU generator state its models' initializers replay."""

    rng: torch.Tensor


@contextlib.contextmanager
def init_empty() -> Iterator[EmptyInit]:
    """Build models inside with their parameters on the meta device (buffers stay real)."""
    record = EmptyInit(rng=torch.get_rng_state())
    register = nn.Module.register_parameter

    def register_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    setattr(nn.Module, "register_parameter", register_meta)  # noqa: B010 -- patched for this block only
    try:
        yield record
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010


def is_empty(model: nn.Module) -> bool:
    """Whether `model` has parameters on the meta device (it must be materialized)."""
    return any(p.is_meta for p in model.parameters())


def _is_transformers(model: nn.Module) -> bool:
    return callable(getattr(model, "_init_weights", None)) and hasattr(model, "config")


def _initializers(model: nn.Module) -> list[tuple[nn.Module, list[Callable[[], None]]]]:
    """(module, its initializers) in the order they run (see the module doc)."""
    out: list[tuple[nn.Module, list[Callable[[], None]]]] = []

    def torch_reset(m: nn.Module) -> list[Callable[[], None]]:
        for name in ("reset_parameters", "_reset_parameters"):
            fn = getattr(m, name, None)
            if callable(fn):
                return [fn]
        return []

    if not _is_transformers(model):
        return [(m, torch_reset(m)) for m in model.modules()]

    def visit(m: nn.Module, owner: nn.Module) -> None:  # transformers' smart_apply: children first
        for child in m.children():
            visit(child, child if _is_transformers(child) else owner)
        init_weights: Callable[[nn.Module], None] = getattr(owner, "_init_weights")  # noqa: B009 -- not nn.Module's
        out.append((m, [*torch_reset(m), functools.partial(init_weights, m)]))

    visit(model, model)
    return out


Place = tuple[int, str, str]  # (id of the module, "p" or "b", name): where a tensor sits


def empty_places(model: nn.Module) -> set[Place]:
    """Where the meta tensors of `model` sit (taken before the strategy allocates them)."""
    return {(id(m), kind, n) for m in model.modules() for kind, store in (("p", m._parameters), ("b", m._buffers))
            for n, t in store.items() if t is not None and t.is_meta}


def _own_tensors(m: nn.Module) -> list[tuple[Place, dict[str, Any], str, torch.Tensor]]:
    """The module's own parameters and buffers (and, where it has parameters of its own, its
    children's: a parent's reset may set them, as MultiheadAttention sets out_proj.bias)."""
    owners = [m] + (list(m.children()) if m._parameters else [])
    return [((id(o), kind, name), store, name, t) for o in owners
            for kind, store in (("p", o._parameters), ("b", o._buffers)) for name, t in store.items() if t is not None]


def _blank(t: torch.Tensor) -> torch.Tensor:
    """A full CPU tensor for `t`, filled with a sentinel (NaN; the minimum for integers)."""
    shape, dtype = t.shape, t.dtype
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype)


def _untouched(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


def write_slice(target: torch.Tensor, full: torch.Tensor) -> None:
    """Store a full value into a prepared tensor: its local shard for a DTensor, else all."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
            local = target._local_tensor
            index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            local.copy_(full[index].reshape(local.shape))
        else:
            target.copy_(full)


def allocate(model: nn.Module, device: torch.device | str) -> None:
    """Allocate an empty model's meta tensors on `device` (a sharded one: its local shard),
    keeping every real buffer as it is (`to_empty` would replace those too)."""
    real = {(id(m), n): b for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta}
    # tied parameters (one object in several places) must stay one object: to_empty makes one
    # new tensor per place when it changes the device away from meta
    first: dict[int, tuple[nn.Module, str]] = {}
    ties: list[tuple[nn.Module, str, nn.Module, str]] = []
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None:
                if id(p) in first:
                    ties.append((m, n, *first[id(p)]))
                else:
                    first[id(p)] = (m, n)
    model.to_empty(device=device)
    for m in model.modules():
        for n in list(m._buffers):
            if (id(m), n) in real:
                m._buffers[n] = real[(id(m), n)].to(device)
    for m, n, owner, name in ties:
        m._parameters[n] = owner._parameters[name]


@torch.no_grad()
def materialize(model: nn.Module, places: set[Place], *, rng: torch.Tensor | None, write: Writer = write_slice,
                skip: Callable[[str], bool] = lambda name: False) -> None:
    """Initialize the tensors at `places` (allocated, uninitialized) with the model's own
    initializers, module by module, on full CPU tensors; `write` stores each value (its
    slice, for a sharded tensor).

    `rng`: the CPU generator state the initializers start from (the caller's generator is left
    as it was). `skip(name)`: tensors another source fills (pretrained weights).
    Raises ConfigError naming the tensors no initializer wrote.
    """
    names: dict[Place, str] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        for kind, store in (("p", m._parameters), ("b", m._buffers)):
            for n in store:
                names.setdefault((id(m), kind, n), f"{prefix}.{n}" if prefix else n)
    written: set[int] = set()  # tensors (by id: tied ones sit in two places) given a value
    unset: dict[str, int] = {}
    with torch.random.fork_rng(devices=[]):
        if rng is not None:
            torch.set_rng_state(rng)
        for module, inits in _initializers(model):
            todo = [(pl, s, n, t) for pl, s, n, t in _own_tensors(module) if pl in places and not skip(names[pl])]
            if not todo:
                continue
            blanks = [(pl, s, n, t, _blank(t)) for pl, s, n, t in todo]
            for _, s, n, t, b in blanks:  # the initializers see full CPU tensors
                s[n] = nn.Parameter(b, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else b
            try:
                for fn in inits:
                    fn()
            finally:
                for _, s, n, t, _ in blanks:
                    s[n] = t
            for pl, _, _, t, b in blanks:
                if _untouched(b):
                    unset.setdefault(names[pl], id(t))
                    continue
                write(t, b)
                written.add(id(t))
    missing = [n for n, key in unset.items() if key not in written]
    if missing:
        raise ConfigError(
            f"{type(model).__name__} was built empty (meta device) and no initializer sets "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: give its module a "
            "reset_parameters(), build it normally, or load its weights (engine.from_pretrained)"
        )
