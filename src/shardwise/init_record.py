"""What a model's constructor did to its parameters under `init_empty()`, to do again at `prepare`.

Under `init_empty()` a parameter lives on the meta device, so an initializer the constructor
calls on it (`reset_parameters`, `nn.init.zeros_`, a `transformers` `post_init`) computes
nothing. A `TorchFunctionMode` watches those calls instead and keeps, per parameter, a recipe:

- its start value: the real tensor the constructor registered (`nn.Parameter(torch.ones(4))`),
  or none when it came from `torch.empty` (nn.Linear's weight before its reset);
- the in-place writes to it or to a view of it (`normal_`, `zero_`, `fill_`, `copy_` from a real
  tensor, `mul_`, `p[idx].fill_(0)`, ...), each with the CPU generator state it started from.

The generator is kept in step with a normal build: a random write to a meta tensor is also run
once on a scratch CPU tensor of the same shape (freed at once), so the draws the constructor
makes next (a real buffer's, the next layer's) are the ones a normal build makes. At `prepare`
each parameter is replayed on its own, from its last whole overwrite, with the recorded states:
bit for bit the value a normal build gives it with the same seed, whatever the process count,
and no process holds more than one full parameter for it. A write the recipe cannot carry (one
that reads another meta tensor, as `nn.init.orthogonal_` does) makes the parameter unreplayable;
`materialize` then refuses it by name, or runs the model's `init_weights()`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .internals import no_grad_trunc_normal, tree_map, view_base

ATTR = "_shardwise_init"  # on a meta parameter made by init_empty(): its InitRecipe

_SELF = object()  # stands for the written tensor in a recorded call's arguments
_EMPTY_FACTORIES = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
# write every element whatever was there (torch.nn.init's functions, and tensor methods)
_WHOLE = {
    "_no_grad_trunc_normal_", "normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_",
    "geometric_", "log_normal_", "cauchy_", "bernoulli_", "trunc_normal_", "constant_", "ones_", "zeros_",
    "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
    "orthogonal_", "sparse_",
}
_NO_DRAWS = {
    "constant_", "ones_", "zeros_", "eye_", "dirac_", "zero_", "fill_", "copy_", "mul_", "add_", "sub_",
    "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "masked_fill_", "fill_diagonal_", "__setitem__",
    "requires_grad_", "abs_", "neg_", "sqrt_", "exp_", "log_", "pow_", "tanh_", "sigmoid_", "t_",
    "transpose_", "squeeze_", "unsqueeze_",
}
# torch.nn.init functions that skip a meta tensor without a call the mode would see
_SHORTCUTS = {
    f.__code__: f for f in (no_grad_trunc_normal(), nn.init.orthogonal_, nn.init.dirac_, nn.init.sparse_)
}
# the property getter the mode sees (torch.Tensor inherits the descriptor from its C base class)
_IS_META = inspect.getattr_static(torch.Tensor, "is_meta").__get__
_METADATA = {"requires_grad_", "share_memory_", "retain_grad_"}  # change no value
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"}


@dataclass(slots=True)
class _Call:
    func: Callable[..., Any]
    args: tuple[Any, ...]  # _SELF where the target goes; real tensors cloned
    kwargs: dict[str, Any]
    gen_states: dict[int, torch.Tensor] = field(default_factory=dict)  # position of a Generator arg -> state

    def run(self, target: torch.Tensor) -> Any:
        def sub(a: Any) -> Any:
            return target if a is _SELF else a

        args = [sub(a) for a in self.args]
        kwargs = {k: sub(v) for k, v in self.kwargs.items()}
        for pos, state in self.gen_states.items():  # a generator the call was given: as it was then
            g = torch.Generator().set_state(state)
            if pos >= 0:
                args[pos] = g
            else:
                kwargs["generator"] = g
        return self.func(*args, **kwargs)


@dataclass(slots=True)
class _Write:
    view: tuple[_Call, ...]  # how to reach the written part from the parameter; () is all of it
    call: _Call
    rng: torch.Tensor | None  # the CPU generator state before a call that draws
    whole: bool  # overwrites every element of the parameter
    problem: str | None = None  # why it cannot be replayed


@dataclass(slots=True)
class InitRecipe:
    """How the constructor initialized one parameter (see the module doc)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: torch.Tensor | None  # the registered real value; None: uninitialized (torch.empty)
    writes: list[_Write] = field(default_factory=list)

    def add(self, write: _Write) -> None:
        if write.whole and write.problem is None:
            self.writes.clear()  # earlier writes no longer matter (their draws are recorded in the states)
            self.start = None  # nor does the start value: let its memory go
        self.writes.append(write)

    def problem(self) -> str | None:
        """Why this recipe cannot give the parameter's value (None: it can)."""
        bad = [w.problem for w in self.writes if w.problem is not None]
        if bad:
            return bad[-1]
        if self.start is None and not (self.writes and self.writes[0].whole):
            return "nothing in its constructor initializes it (it comes from torch.empty)"
        return None

    def replay(self) -> torch.Tensor:
        """The parameter's value as a normal build computes it (check `problem()` first)."""
        value = self.start.clone() if self.start is not None else torch.empty(self.shape, dtype=self.dtype)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for w in self.writes:
                if w.rng is not None:
                    torch.set_rng_state(w.rng)
                target = value
                for v in w.view:
                    target = v.run(target)
                w.call.run(target)
        return value


def recipe_of(param: torch.Tensor) -> InitRecipe | None:
    return getattr(param, ATTR, None)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "")


class Recorder(TorchFunctionMode):
    """Records, while `init_empty()` is open, what the constructor does to meta parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.aliases: dict[int, tuple[torch.Tensor, InitRecipe, tuple[_Call, ...], bool]] = {}
        self.blank: set[int] = set()  # storages (data pointers) from torch.empty not yet written
        self.depth = 0  # inside a call being handled: its inner calls are part of it
        self.last_frame: Any = None  # the last torch.nn.init call recorded from its frame

    def track(self, param: torch.Tensor, real: torch.Tensor) -> None:
        """A parameter just moved to meta; `real`: the tensor the constructor registered."""
        start = None if real.numel() and _storage(real) in self.blank else real.detach()
        recipe = InitRecipe(tuple(param.shape), param.dtype, start)
        setattr(param, ATTR, recipe)
        self.aliases[id(param)] = (param, recipe, (), True)

    def _lookup(self, t: Any) -> tuple[torch.Tensor, InitRecipe, tuple[_Call, ...], bool] | None:
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        hit = self.aliases.get(id(t))
        if hit is not None and hit[0] is t:
            return hit
        recipe = recipe_of(t)  # a parameter made in an earlier init_empty block, or re-registered
        if recipe is not None:
            self.aliases[id(t)] = (t, recipe, (), True)
            return self.aliases[id(t)]
        return None

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        self.depth += 1
        try:
            return self._handle(func, args, kwargs)
        finally:
            self.depth -= 1

    def _handle(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        name = _name(func)
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
        out = kwargs.get("out")
        written = self._lookup(out) if out is not None else None
        inplace = (
            (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS
        ) and name not in _METADATA
        if written is None and inplace:
            written = self._lookup(target)
        if written is None and name == "__get__" and func == _IS_META:
            self._meta_shortcut(target)
        if written is not None:
            self._record(func, name, args, kwargs, written, out is not None)
        elif inplace and isinstance(target, torch.Tensor) and target.is_meta and name not in _NO_DRAWS:
            self._advance(func, args, kwargs, target)  # a draw into some other meta tensor (orthogonal_'s)
        elif inplace and isinstance(target, torch.Tensor) and not target.is_meta:
            self.blank.discard(_storage(target))
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and not result.is_meta:
            (self.blank.add if name in _EMPTY_FACTORIES else self.blank.discard)(_storage(result))
        source = self._lookup(target) if written is None else None
        if (
            source is not None
            and isinstance(result, torch.Tensor)
            and result.is_meta
            and result is not target
            and isinstance(target, torch.Tensor)
        ):
            self._alias(func, args, kwargs, source, target, result)
        return result

    def _meta_shortcut(self, target: Any) -> None:
        """torch.nn.init's trunc_normal_, orthogonal_, dirac_ and sparse_ return at once on a
        meta tensor after reading `is_meta`: record the whole call, from its frame's arguments."""
        tracked = self._lookup(target)
        frame: FrameType | None = sys._getframe(2)
        for _ in range(6):
            if frame is None or frame.f_code in _SHORTCUTS:
                break
            frame = frame.f_back
        if tracked is None or frame is None or frame.f_code not in _SHORTCUTS or frame is self.last_frame:
            return
        self.last_frame = frame
        code = frame.f_code
        kwargs = {n: frame.f_locals[n] for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]}
        self._record(_SHORTCUTS[code], _SHORTCUTS[code].__name__, (), kwargs, tracked, False)

    def _alias(self, func: Callable[..., Any], args: Any, kwargs: Any, source: tuple[Any, ...],
               target: torch.Tensor, result: torch.Tensor) -> None:
        """`result` is a view of a tracked tensor (`p.data`, `p[0]`, `p.view(...)`): remember the way."""
        _, recipe, view, whole = source
        base = view_base(target)
        root = base if base is not None else target
        made_from = view_base(result)
        if not (made_from is root or (made_from is None and result.shape == target.shape
                                      and _name(func) in ("detach", "__get__"))):
            return
        call = _capture(func, args, kwargs, target)
        if call is None:
            return
        covers = (
            whole
            and tuple(result.shape) == recipe.shape
            and result.stride() == target.stride()
            and result.storage_offset() == target.storage_offset()
        )
        self.aliases[id(result)] = (result, recipe, (*view, call), covers)

    def _record(self, func: Callable[..., Any], name: str, args: Any, kwargs: Any,
                written: tuple[Any, ...], via_out: bool) -> None:
        tensor, recipe, view, covers = written
        problem = None
        call = _capture(func, args, kwargs, tensor)
        if call is None:
            problem = f"{name}() reads another meta tensor"
            call = _Call(func, (), {})
        rng = None
        if name not in _NO_DRAWS:  # run it once for real so the generator moves as in a normal build
            before = torch.get_rng_state()
            for pos, g in _generators(args, kwargs):
                call.gen_states[pos] = g.get_state()
            if problem is None:
                scratch = torch.empty(recipe.shape, dtype=recipe.dtype)
                with torch.no_grad():  # (the mode is off inside its own handler)
                    part = scratch
                    for v in view:
                        part = v.run(part)
                    call.run(part)
                del scratch
                if not torch.equal(torch.get_rng_state(), before):
                    rng = before
        whole = covers and (via_out or name in _WHOLE)
        recipe.add(_Write(view, call, rng, whole, problem))

    def _advance(self, func: Callable[..., Any], args: Any, kwargs: Any, target: torch.Tensor) -> None:
        call = _capture(func, args, kwargs, target)
        if call is not None:
            with torch.no_grad():
                call.run(torch.empty(target.shape, dtype=target.dtype))


def _storage(t: torch.Tensor) -> int:
    """The data pointer of a tensor's storage (0: none, or empty)."""
    try:
        return int(t.untyped_storage().data_ptr()) if t.numel() else 0
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, subclass tensors
        return 0


def _generators(args: Any, kwargs: Any) -> Iterator[tuple[int, torch.Generator]]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Generator):
            yield i, a
    if isinstance(kwargs.get("generator"), torch.Generator):
        yield -1, kwargs["generator"]


def _capture(func: Callable[..., Any], args: Any, kwargs: Any, tensor: torch.Tensor) -> _Call | None:
    """The call with `tensor` replaced by _SELF and real tensors cloned; None if it reads
    another meta tensor (its value is unknown here)."""
    bad = False

    def keep(a: Any) -> Any:
        nonlocal bad
        if a is tensor:
            return _SELF
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                bad = True
                return a
            return a.detach().clone()
        return a

    args = tuple(keep(a) if not isinstance(a, (list, tuple)) else tree_map(keep, a) for a in args)
    kwargs = {k: keep(v) for k, v in kwargs.items()}
    return None if bad else _Call(func, args, kwargs)
