"""What a model's constructor did to its parameters under `init_empty()`, to do again at `prepare`.

Under `init_empty()` a parameter lives on the meta device, so an initializer the constructor
calls on it (`reset_parameters`, `nn.init.zeros_`, a `transformers` `post_init`) computes
nothing. A `TorchFunctionMode` watches those calls instead and keeps, per parameter, a recipe:

- its start value: how the tensor the constructor registered was made (`torch.ones(n)`,
  `torch.randn(n) * 0.02`: the calls, not the values), or none when it came from `torch.empty`
  (nn.Linear's weight before its reset);
- the in-place writes to it or to a view of it (`normal_`, `zero_`, `fill_`, `copy_` from a real
  tensor, `mul_`, `p[idx].fill_(0)`, ...), each with the CPU generator state it started from.

Memory: building the model holds no parameter's values. A registered tensor is moved to meta at
once (the constructor's `torch.empty` was never written, so its pages were never touched); a
real tensor the recipe needs (a start value, a `copy_` source) is kept as it is up to
`KEEP_BYTES`, else as the calls that made it inside the block (`Made`, recomputed at
`prepare`), else, made elsewhere, in a temporary file (`Spilled`). The generator is kept in step
with a normal build by counting the draws each random write would make and moving the generator
on by that many in bounded chunks (`shardwise.weights.draws`), so the draws the constructor makes next
(a real buffer's, the next layer's) are the ones a normal build makes.

At `prepare` each parameter is replayed on its own, from its last whole overwrite, with the
recorded states: bit for bit the value a normal build gives it with the same seed, whatever the
process count, and no process holds more than one full parameter for it. A write the recipe
cannot carry (one that reads another meta tensor) makes the parameter unreplayable;
`materialize` then refuses it by name, or runs the model's `init_weights()`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..distributed.internals import no_grad_trunc_normal, storage_ref, tree_map, version_of, view_base
from .draws import Stepper
from .held import SELF, Call, Held, Made, Spilled

ATTR = "_shardwise_init"  # on a meta parameter made by init_empty(): its InitRecipe

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


# arguments a recipe of a real tensor keeps as they are (anything else, a numpy array say, may
# hold the tensor's values: such a tensor is held by value or spilled instead)
_PLAIN = (int, float, bool, complex, str, type(None), type(...), slice, torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.Generator, torch.Size, list, tuple)
KEEP_BYTES = 1 << 20  # a real tensor a recipe needs is kept by value up to this size


@dataclass(slots=True)
class _Write:
    view: tuple[Call, ...]  # how to reach the written part from the parameter; () is all of it
    call: Call
    rng: torch.Tensor | None  # the CPU generator state before a call that draws
    whole: bool  # overwrites every element of the parameter
    problem: str | None = None  # why it cannot be replayed


@dataclass(slots=True)
class InitRecipe:
    """How the constructor initialized one parameter (see the module doc)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: Held | None  # the registered value, held; None: uninitialized (torch.empty)
    writes: list[_Write] = field(default_factory=list)

    def add(self, write: _Write) -> None:
        if write.whole and write.problem is None:
            self.writes.clear()  # earlier writes no longer matter (their draws are recorded in the states)
            self.start = None  # nor does the start value: let it go
        self.writes.append(write)

    def problem(self) -> str | None:
        """Why this recipe cannot give the parameter's value (None: it can)."""
        bad = [w.problem for w in self.writes if w.problem is not None]
        if bad:
            return bad[-1]
        if self.start is None and not (self.writes and self.writes[0].whole):
            return "nothing in its constructor initializes it (it comes from torch.empty)"
        return None

    def replay(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """The parameter's value as a normal build computes it (check `problem()` first), in
        `into` if given (a contiguous tensor of its shape and dtype: a reused scratch)."""
        value = into if into is not None else torch.empty(self.shape, dtype=self.dtype)
        if self.start is not None:
            value.copy_(self.start if isinstance(self.start, torch.Tensor) else self.start.value())
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


@contextlib.contextmanager
def recipes_kept(model: nn.Module) -> Iterator[None]:
    """Inside, a transform may replace `model`'s meta parameters with new ones (tensor
    parallelism's DTensors): each new one takes over the recipe of the one it replaced (by module
    and name), so the replay still gives it the value a normal build would."""
    before = {(id(m), n): r for m in model.modules() for n, p in m._parameters.items()
              if p is not None and (r := recipe_of(p)) is not None}
    yield
    for m in model.modules():
        for n, p in m._parameters.items():
            recipe = before.get((id(m), n))
            if p is not None and recipe is not None and recipe_of(p) is None:
                setattr(p, ATTR, recipe)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "")


class _Origin(NamedTuple):
    """What made the tensor of this layout on a storage, at this count of in-place writes."""

    layout: tuple[Any, ...]  # shape, stride, storage offset, dtype
    version: int
    made: Made


class _Before(NamedTuple):
    """Generator states just before a call (to replay it, and to tell whether it drew)."""

    rng: torch.Tensor
    generators: dict[int, torch.Tensor]

    def drawn(self) -> torch.Tensor | None:
        """The CPU generator state before the call if the call moved it, else None."""
        return None if torch.equal(torch.get_rng_state(), self.rng) else self.rng


def _before(args: Any, kwargs: Any) -> _Before:
    return _Before(torch.get_rng_state(), {pos: g.get_state() for pos, g in _generators(args, kwargs)})


class Recorder(TorchFunctionMode):
    """Records, while `init_empty()` is open, what the constructor does to meta parameters, and
    how it makes the real tensors they may start from (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.aliases: dict[int, tuple[torch.Tensor, InitRecipe, tuple[Call, ...], bool]] = {}
        # storage (weakly) -> how the tensors on it were made; entries die with their storage
        self.origins: dict[Any, list[_Origin]] = {}
        self.sweep_at = 1024  # prune dead storages when the table grows past this
        self.stepper = Stepper()
        self.depth = 0  # inside a call being handled: its inner calls are part of it
        self.last_frame: Any = None  # the last torch.nn.init call recorded from its frame

    def track(self, param: torch.Tensor, real: torch.Tensor) -> None:
        """A parameter just moved to meta; `real`: the tensor the constructor registered."""
        made = self.made_of(real)
        start = None if made is not None and made.call is None else self.hold(real, spill=True)
        recipe = InitRecipe(tuple(param.shape), param.dtype, start)
        setattr(param, ATTR, recipe)
        self.aliases[id(param)] = (param, recipe, (), True)

    # -- real tensors: how they were made ---------------------------------------------------------
    def made_of(self, t: torch.Tensor) -> Made | None:
        """How `t`'s current value was made inside the block, if the recorder saw all of it."""
        ref = _ref(t)
        if ref is None:
            return None
        layout, version = _layout(t), version_of(t)
        for origin in self.origins.get(ref, ()):
            if origin.layout == layout and origin.version == version:
                return origin.made
        return None

    def hold(self, t: torch.Tensor, *, spill: bool) -> Held | None:
        """What a recipe keeps of real tensor `t`: a copy if small, else how it was made, else
        (with `spill`) a temporary file; None: none of these."""
        if t.numel() * t.element_size() <= KEEP_BYTES:
            return t.detach().clone()
        made = self.made_of(t)
        if made is not None:
            return made
        return Spilled(t) if spill else None

    def _remember(self, t: torch.Tensor, made: Made) -> None:
        ref = _ref(t)
        if ref is None:
            return
        layout, version = _layout(t), version_of(t)
        kept = [o for o in self.origins.get(ref, ()) if o.version == version and o.layout != layout]
        self.origins[ref] = [*kept, _Origin(layout, version, made)]
        if len(self.origins) > self.sweep_at:
            self.origins = {r: o for r, o in self.origins.items() if not r.expired()}
            self.sweep_at = max(1024, 2 * len(self.origins))

    def _note(self, func: Callable[..., Any], name: str, args: Any, kwargs: Any, target: Any,
              prior: Made | None, before: _Before, result: Any) -> None:
        """After a call on real tensors: remember how its result was made where it may matter
        (any tensor from torch.empty; in-place writes to one already known; large new ones)."""
        if not isinstance(result, torch.Tensor) or _ref(result) is None:
            return
        shape, dtype = tuple(result.shape), result.dtype
        if name in _EMPTY_FACTORIES:
            self._remember(result, Made(None, None, shape, dtype))
        elif prior is not None:  # an in-place write to a tensor whose making is known
            if result is not target or (prior.call is None and name not in _WHOLE):
                return  # (a partial write to torch.empty's memory reads what was there)
            call = self._capture(func, args, kwargs, target, spill=False)
            if call is not None:
                call.gen_states = before.generators
                self._remember(target, Made(call, before.drawn(), shape, dtype, into=prior))
        elif result.numel() * result.element_size() > KEEP_BYTES and not any(result is a for a in args):
            call = self._capture(func, args, kwargs, None, spill=False)
            if call is not None:
                call.gen_states = before.generators
                self._remember(result, Made(call, before.drawn(), shape, dtype))

    # -- the mode ----------------------------------------------------------------------------------
    def _lookup(self, t: Any) -> tuple[torch.Tensor, InitRecipe, tuple[Call, ...], bool] | None:
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
        if written is not None:
            self._record(func, name, args, kwargs, written, out is not None)
            return func(*args, **kwargs)
        on_meta = isinstance(target, torch.Tensor) and target.is_meta
        if inplace and on_meta and isinstance(target, torch.Tensor) and name not in _NO_DRAWS:
            self._advance(func, name, args, kwargs, target)  # a draw into some other meta tensor
            return func(*args, **kwargs)
        if name == "__get__":
            if func == _IS_META:
                self._meta_shortcut(target)
            result = func(*args, **kwargs)
        else:
            prior = self.made_of(target) if inplace and isinstance(target, torch.Tensor) else None
            before = _before(args, kwargs)
            result = func(*args, **kwargs)
            if out is None and not on_meta:
                self._note(func, name, args, kwargs, target, prior, before, result)
        source = self._lookup(target)
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
        call = self._capture(func, args, kwargs, target, spill=True)
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
        """A write to a tracked meta parameter (or a view of it): add it to the recipe, and move
        the generator on as the write would have."""
        tensor, recipe, view, covers = written
        problem = None
        call = self._capture(func, args, kwargs, tensor, spill=True)
        if call is None:
            problem = f"{name}() reads another meta tensor"
            call = Call(func, (), {})
        rng = None
        if name not in _NO_DRAWS:
            before = _before(args, kwargs)
            call.gen_states = before.generators
            part = _written_part(recipe, view)
            if problem is None:
                self._step(func, name, args, kwargs, tensor, part)
            else:  # it cannot run here; its draws may still be counted
                draws = self.stepper.draws(name, kwargs, part)
                if draws is not None:
                    self.stepper.skip(_generator(args, kwargs), draws)
            rng = before.drawn()
        whole = covers and (via_out or name in _WHOLE)
        recipe.add(_Write(view, call, rng, whole, problem))

    def _advance(self, func: Callable[..., Any], name: str, args: Any, kwargs: Any,
                 target: torch.Tensor) -> None:
        """A random write into a meta tensor nobody tracks (orthogonal_'s scratch matrix): the
        generator moves as in a normal build."""
        self._step(func, name, args, kwargs, target, target)

    def _step(self, func: Callable[..., Any], name: str, args: Any, kwargs: Any,
              tensor: torch.Tensor, part: torch.Tensor) -> None:
        def scratch(real: torch.Tensor) -> None:  # the call itself, on a real tensor of part's shape
            def swap(a: Any) -> Any:
                return real if a is tensor else a

            func(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})

        self.stepper.step(name, kwargs, part, _generator(args, kwargs), scratch)

    def _capture(self, func: Callable[..., Any], args: Any, kwargs: Any, tensor: torch.Tensor | None,
                 *, spill: bool) -> Call | None:
        """The call with `tensor` replaced by SELF and other real tensors held (`hold`); None if
        it reads a meta tensor (its value is unknown here) or a tensor it cannot hold."""
        bad = False

        def keep(a: Any) -> Any:
            nonlocal bad
            if tensor is not None and a is tensor:
                return SELF
            if isinstance(a, torch.Tensor):
                held = None if a.is_meta else self.hold(a, spill=spill)
                bad = bad or held is None
                return a if held is None else held
            # a recipe of a tensor made here keeps its arguments: values, never someone's array
            bad = bad or (not spill and not isinstance(a, _PLAIN))
            return a

        args = tuple(keep(a) if not isinstance(a, (list, tuple)) else tree_map(keep, a) for a in args)
        kwargs = {k: keep(v) for k, v in kwargs.items()}
        return None if bad else Call(func, args, kwargs)


def _written_part(recipe: InitRecipe, view: tuple[Call, ...]) -> torch.Tensor:
    """A meta tensor with the shape and layout of the part of the parameter a write reaches."""
    part = torch.empty(recipe.shape, dtype=recipe.dtype, device="meta")
    for v in view:
        part = v.run(part)
    return part


def _ref(t: Any) -> Any:
    """A weak reference to a real tensor's storage (None: meta, or a tensor without one)."""
    if not isinstance(t, torch.Tensor) or t.is_meta or type(t) not in (torch.Tensor, nn.Parameter):
        return None
    try:
        return storage_ref(t)
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested tensors
        return None


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def _generators(args: Any, kwargs: Any) -> Iterator[tuple[int, torch.Generator]]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Generator):
            yield i, a
    if isinstance(kwargs.get("generator"), torch.Generator):
        yield -1, kwargs["generator"]


def _generator(args: Any, kwargs: Any) -> torch.Generator:
    """The generator a call draws from: the one it was given, else the default CPU one."""
    return next((g for _, g in _generators(args, kwargs)), torch.default_generator)
