"""Models built without memory: parameters on the meta device, materialized shard by shard.

`init_empty()` builds a model whose parameters are on the meta device (no bytes) while its
buffers stay real, so non-persistent buffers the model computes in its constructor (rotary
caches, position ids) come out exactly as in a normal build. It also records what the
constructor does to each parameter (`shardwise.weights.record`): `reset_parameters`, `nn.init`
calls, raw `nn.Parameter(torch.ones(4))`, a `transformers` model's `post_init`, with the
generator state of every draw, kept in step with a normal build. A model built under
`torch.device("meta")` is accepted too; its buffers are then the initializers' job
(`transformers` models' `_init_weights` computes rotary caches).

At `prepare`, the strategy shards (or replicates) the empty model and `materialize` fills it
(see its doc for the order): each parameter's recorded initialization is replayed in turn into
one full-size CPU scratch (the largest parameter's size, reused) and each process keeps only its
slice (`write`). That is the value a normal build with the same seed gives it, bit for bit, at
any process count or strategy; no two shards of a parameter are copies of each other (per-shard
random init would make them so), and no process holds more than its shards plus that scratch.
What the record cannot carry is refused by name before any sharding, unless a module defines
`init_weights()` (torchtitan's convention), which then initializes its subtree on full CPU
tensors. Tensors with no record (a model built on meta) get the modules' own initializers,
module by module, with the generator set to its state at `init_empty()` (or now).

`model.load_state_dict(sd)` after `init_empty()` gives the loaded parameters real memory (a
pre-hook; torch would copy into meta, a no-op) and `prepare` keeps them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..config.tree import ConfigError
from ..distributed.internals import local_part, local_tensor
from .record import InitRecipe, Recorder, recipe_of

SliceWriter = Callable[[torch.Tensor, torch.Tensor], None]  # (prepared tensor, full value) -> store its slice


@dataclass
class EmptyInit:
    """The CPU generator state when `init_empty()` began (for `init_weights()` and initializers)."""

    rng: torch.Tensor


@contextlib.contextmanager
def init_empty() -> Iterator[EmptyInit]:
    """Build models inside with their parameters on the meta device (buffers stay real), and
    record what their constructors do to those parameters (`shardwise.weights.record`)."""
    record = EmptyInit(rng=torch.get_rng_state())
    recorder = Recorder()

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        """torch's parameter-registration hook: the parameter registered is a meta one."""
        if param is None or param.is_meta:
            return None
        meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        recorder.track(meta, param)
        if not getattr(module, _HOOKED, False):
            module.register_load_state_dict_pre_hook(_load_into_meta)
            object.__setattr__(module, _HOOKED, True)
        return meta

    # (torch annotates the hook as returning None; its code and docs take a returned parameter)
    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]
    try:
        with recorder:
            yield record
    finally:
        handle.remove()


_HOOKED = "_shardwise_load_hook"


def _load_into_meta(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *_: Any
) -> None:
    """`model.load_state_dict(sd)` on a model built by init_empty: torch would copy into meta
    parameters, a no-op, and prepare would then initialize them afresh. Give each loaded
    parameter real memory first, so the copy lands and prepare keeps the value."""
    if local_metadata.get("assign_to_params_buffers"):
        return  # assign=True puts the file's tensors in place: real already
    for name, p in list(module._parameters.items()):
        value = state_dict.get(prefix + name)
        if (
            p is not None
            and p.is_meta
            and isinstance(value, torch.Tensor)
            and not value.is_meta
            and value.shape == p.shape
        ):
            module._parameters[name] = type(p)(
                torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
            )


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


Places = dict[Place, InitRecipe | None]  # each meta tensor, and how its constructor initialized it


def empty_places(model: nn.Module) -> Places:
    """Where the meta tensors of `model` sit, each with its constructor's recipe (taken before
    the strategy replaces the parameters). A parameter whose recipe cannot be replayed, under no
    module with an `init_weights()`, is refused here, before any work."""
    places: Places = {(id(m), kind, n): recipe_of(t) if kind == "p" else None for m in model.modules()
                      for kind, store in (("p", m._parameters), ("b", m._buffers))
                      for n, t in store.items() if t is not None and t.is_meta}
    covered = {
        (id(s), kind, n)
        for m in model.modules()
        if _init_weights_of(m) is not None
        for s in m.modules()
        for kind in ("p", "b")
        for n in (s._parameters if kind == "p" else s._buffers)
    }
    for prefix, m in model.named_modules():
        for n in m._parameters:
            recipe = places.get((id(m), "p", n))
            problem = recipe.problem() if recipe is not None else None
            if problem is not None and "reads" in problem and (id(m), "p", n) not in covered:
                raise ConfigError(_cannot(model, f"{prefix}.{n}" if prefix else n, problem))
    return places


def _cannot(model: nn.Module, name: str, why: str) -> str:
    cls = type(model).__name__
    return (
        f"{cls}.{name} was built under init_empty() and shardwise cannot reproduce its initialization "
        f"({why}): give {cls} an init_weights() method that initializes its parameters (shardwise calls "
        "it at prepare on whole CPU tensors), or build the model normally"
    )


def _replayable(recipe: InitRecipe | None) -> bool:
    return recipe is not None and recipe.problem() is None


def _init_weights_of(m: nn.Module) -> Callable[[], None] | None:
    """A module's own `init_weights()` (torchtitan's convention); transformers' is its post_init."""
    fn = getattr(m, "init_weights", None)
    if not callable(fn) or _is_transformers(m) or hasattr(m, "post_init"):
        return None
    return cast(Callable[[], None], fn)


def _own_tensors(m: nn.Module) -> list[tuple[Place, dict[str, Any], str, torch.Tensor]]:
    """The module's own parameters and buffers (and, where it has parameters of its own, its
    children's: a parent's reset may set them, as MultiheadAttention sets out_proj.bias)."""
    owners = [m] + (list(m.children()) if m._parameters else [])
    return [
        ((id(o), kind, name), store, name, t)
        for o in owners
        for kind, store in (("p", o._parameters), ("b", o._buffers))
        for name, t in store.items()
        if t is not None
    ]


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
            local = local_tensor(target)
            local.copy_(local_part(full, target).reshape(local.shape))
        else:
            target.copy_(full)


def allocate(model: nn.Module, device: torch.device | str) -> None:
    """Allocate an empty model's meta tensors on `device` (a sharded one: its local shard),
    keeping every real buffer as it is (`to_empty` would replace those too)."""
    real = {
        (id(m), n): b
        for m in model.modules()
        for n, b in m._buffers.items()
        if b is not None and not b.is_meta
    }
    # parameters made real before prepare (load_state_dict after init_empty) keep their values:
    # to_empty replaces them too; their (local) tensors are held here and copied back
    loaded = {(id(m), n): local_tensor(p).detach()
              for m in model.modules() for n, p in m._parameters.items() if p is not None and not p.is_meta}
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
    with torch.no_grad():
        for m in model.modules():
            for n, p in m._parameters.items():
                if p is not None and (id(m), n) in loaded:
                    local_tensor(p).copy_(loaded[(id(m), n)])


class _Scratch:
    """One buffer, the size of the largest parameter to replay, that every replay fills in turn:
    a fresh full tensor per parameter would leave the allocator's heap with holes of every size
    next to the shards (measured: a tenth of the model per process on a 91M GPT-2)."""

    def __init__(self, recipes: list[InitRecipe]) -> None:
        sizes = [math.prod(r.shape) * r.dtype.itemsize for r in recipes]
        self.raw = torch.empty(max(sizes, default=0), dtype=torch.uint8)

    def take(self, recipe: InitRecipe) -> torch.Tensor:
        n = math.prod(recipe.shape) * recipe.dtype.itemsize
        return self.raw[:n].view(recipe.dtype).view(recipe.shape)


@torch.no_grad()
def materialize(model: nn.Module, places: Places, *, rng: torch.Tensor | None,
                write: SliceWriter = write_slice, skip: Callable[[str], bool] = lambda name: False) -> None:
    """Initialize the tensors at `places` (allocated, uninitialized); `write` stores each value
    (its slice, for a sharded tensor). In order of preference:

    1. a module's `init_weights()`, for its whole subtree, where some tensor in it has no
       replayable recipe (a model built under `torch.device("meta")`, or an init shardwise
       cannot record);
    2. the constructor's recorded writes, replayed one parameter at a time (`weights.record`):
       the value a normal build gives it;
    3. the modules' own initializers (`reset_parameters`, transformers' `_init_weights`), module
       by module on full CPU tensors, for what is left.

    `rng`: the CPU generator state 1. and 3. start from (the caller's generator is left as it
    was). `skip(name)`: tensors another source fills (pretrained weights).
    Raises ConfigError naming the tensors nothing wrote.
    """
    fill = _Fill(model, places, write, skip)
    with torch.random.fork_rng(devices=[]):
        fill.by_init_weights(rng)  # 1.
        fill.by_recipes()  # 2.
        if rng is not None:
            torch.set_rng_state(rng)
        fill.by_initializers()  # 3.
    missing = [n for n, key in fill.unset.items() if key not in fill.written]
    if missing:
        raise ConfigError(_cannot(model, ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else ""),
                                  "nothing initializes it: its constructor leaves it empty and no "
                                  "reset_parameters() writes it"))


class _Fill:
    """One `materialize`: where each tensor sits, what is left to fill, what was written."""

    def __init__(self, model: nn.Module, places: Places, write: SliceWriter,
                 skip: Callable[[str], bool]) -> None:
        self.model, self.write = model, write
        self.names: dict[Place, str] = {}
        self.where: dict[Place, tuple[dict[str, Any], str]] = {}
        for prefix, m in model.named_modules(remove_duplicate=False):
            for kind, store in (("p", m._parameters), ("b", m._buffers)):
                for n in store:
                    self.names.setdefault((id(m), kind, n), f"{prefix}.{n}" if prefix else n)
                    self.where[(id(m), kind, n)] = (store, n)
        # another source fills a tensor under any of its names (a tied head shares the embedding's)
        filled = {id(self.tensor(pl)) for pl in places if pl in self.where and skip(self.names[pl])}
        self.todo = {pl: r for pl, r in places.items()
                     if pl in self.where and id(self.tensor(pl)) not in filled}
        self.written: set[int] = set()  # tensors (by id: tied ones sit in two places) given a value
        self.unset: dict[str, int] = {}  # name -> tensor an initializer left untouched

    def tensor(self, pl: Place) -> torch.Tensor:
        store, n = self.where[pl]
        return cast(torch.Tensor, store[n])

    def by_init_weights(self, rng: torch.Tensor | None) -> None:
        """1. pre-order: an outer init_weights() covers its inner ones."""
        for m in self.model.modules():
            fn = _init_weights_of(m)
            if fn is None:
                continue
            mine = [pl for s in m.modules() for pl in self.todo if pl[0] == id(s)]
            if all(_replayable(self.todo[pl]) for pl in mine if pl[1] == "p"):
                continue
            if rng is not None:
                torch.set_rng_state(rng)
            self.run([fn], mine)
            for pl in mine:
                del self.todo[pl]

    def by_recipes(self) -> None:
        """2. each parameter's recorded init, replayed in turn into one reused scratch."""
        scratch = _Scratch([r for r in self.todo.values() if r is not None and _replayable(r)])
        for pl, recipe in list(self.todo.items()):
            if recipe is None or not _replayable(recipe):
                continue
            t = self.tensor(pl)
            if id(t) not in self.written:
                self.write(t, recipe.replay(into=scratch.take(recipe)))
                self.written.add(id(t))
            del self.todo[pl]

    def by_initializers(self) -> None:
        """3. the modules' own initializers, module by module, for what is left."""
        for module, inits in _initializers(self.model):
            mine = [pl for pl, _, _, _ in _own_tensors(module) if pl in self.todo]
            if mine:
                self.run(inits, mine)

    def run(self, inits: list[Callable[[], None]], mine: list[Place]) -> None:
        """Run initializers on full CPU blanks swapped in for the tensors at `mine`; write them."""
        blanks = []
        for pl in mine:
            store, n = self.where[pl]
            t = store[n]
            b = _blank(t)
            blanks.append((pl, store, n, t, b))
            store[n] = nn.Parameter(b, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else b
        try:
            for fn in inits:
                fn()
        finally:
            for _, store, n, t, _ in blanks:
                store[n] = t
        for pl, _, _, t, b in blanks:
            if _untouched(b):
                self.unset.setdefault(self.names[pl], id(t))
            else:  # a later initializer of the same tensor overwrites an earlier one, as it would
                self.write(t, b)
                self.written.add(id(t))
