"""Tensor parallelism: a model's layers split across the `tp` dimension of the mesh (DTensor).

A plan maps module paths (`*` matches one name: `layers.*.mlp.up_proj`) to how that module is
split over the tp ranks:
  colwise                 a Linear's output features split (its weight's rows): the output
                          stays sharded on the last dimension, for a rowwise layer to consume;
  rowwise                 a Linear's input features split: it consumes a colwise output and
                          all-reduces its own (one all-reduce per rowwise layer, forward and
                          backward);
  colwise_gather_output   colwise, with the output gathered whole (a head whose logits the loss
                          reads);
  embedding_rowwise       an Embedding's rows (the vocabulary) split, the output all-reduced;
  colwise_qkv             colwise for a fused query/key/value projection: each third split by
                          heads, so every rank holds [its queries, its keys, its values];
  replicate               left whole on every tp rank (a name kept for plans that list it).
colwise, rowwise and colwise_qkv also take GPT-2's `Conv1D` (a Linear whose weight is stored
transposed). Where the plan comes from: the user's `tensor_parallel_plan`; else the model's own
`tensor_parallel_plan` attribute (a model of one's own, like examples/gpt.py); else a transformers
model's `config.base_model_tp_plan` (under the base model's prefix: Llama, Mistral, Qwen, Gemma,
...); else a plan built in here for models that carry none (GPT-2). Attention layers
split by heads, so the heads (and the key/value heads) must divide by tp; a model without a plan,
or whose sizes tp does not divide, is refused at prepare in one line naming the fix.

Sequence parallelism (`sequence_parallel: true`, Megatron's): between the split layers, the
activations are split too, over the sequence (dimension 1) instead of copied on every tp rank. The
residual stream enters the first block as this rank's 1/tp of the tokens and leaves the last one
gathered; each sublayer that holds the colwise layers (an attention, an MLP) all-gathers its input
over the sequence and its rowwise layer reduce-scatters its output back (in backward the
reverse): the bytes of the all-reduce they replace, in two halves. The norms between them run on
this rank's tokens (torch's `SequenceParallel`: their weights Replicate DTensors whose gradients
are summed over the tp ranks), and so do a rowwise layer's whole bias and the dropouts. Norms,
residuals and the block boundaries then hold 1/tp of their activations. The sequence must divide
by tp; each block's attention and MLP must be modules of their own, taking the hidden states first
(or as `hidden_states=`), as transformers' and GPT-2's are.

Memory: each tp rank holds 1/tp of every planned weight (and its gradients and optimizer state);
the data-parallel strategy then shards what each rank holds over the data-parallel ranks
(zero2/zero3: FSDP2 over the dp mesh, after this). Communication per block: the rowwise layers'
all-reduce of the activations (batch x sequence x hidden) in forward and again in backward.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional as F

from ..config.tree import TP_STYLES, ConfigError
from ..distributed.internals import strided_shard

# Plans for models that carry none, by `config.model_type` (paths under the base model). GPT-2's
# attention projects queries, keys and values with one fused Conv1D (c_attn).
BUILT_IN_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {"h.*.attn.c_attn": "colwise_qkv", "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
}
# An attention module's sizes a fused projection's split makes local (GPT-2's split_size and
# num_heads, examples/gpt.py's heads): the per-rank count of its heads and features.
_LOCAL_SIZES = ("split_size", "num_heads", "heads")


def _transposed(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a Linear whose weight is stored (in, out)."""
    return hasattr(module, "nf") and any(c.__name__ == "Conv1D" for c in type(module).__mro__)


def _style(name: str, module: nn.Module, sequence: bool = False) -> ParallelStyle | None:
    if name == "colwise_qkv" or (name in ("colwise", "rowwise") and (_transposed(module) or sequence)):
        return _LocalSplit(name, sequence)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "colwise_loss_parallel":  # logits stay split over the vocabulary (`Engine.loss_parallel`)
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "replicate":
        return None
    raise ConfigError(f"tensor_parallel_plan: {name!r} is not a split this version applies; use one of "
                      f"{', '.join(TP_STYLES)}")


def model_plan(model: nn.Module, given: dict[str, str] | None) -> dict[str, str]:
    """The plan for `model`: the user's `given` one, else the model's `tensor_parallel_plan`
    attribute, else the transformers model's own (its base model's `base_model_tp_plan`) or the one
    built in for its `model_type` (paths prefixed with the base model's attribute); {} when none."""
    if given:
        return dict(given)
    own = getattr(model, "tensor_parallel_plan", None)
    if isinstance(own, dict) and own:
        return dict(own)
    config = getattr(model, "config", None)
    plan = (getattr(config, "base_model_tp_plan", None)
            or BUILT_IN_PLANS.get(getattr(config, "model_type", "")))
    if not plan:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and hasattr(model, prefix) and getattr(model, prefix) is not model
    return {f"{prefix}.{path}" if inner else path: style for path, style in plan.items()}


def _matches(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """Every module path of `model` a plan entry names, with its split."""
    found: dict[str, str] = {}
    names = [name for name, _ in model.named_modules() if name]
    for pattern, style in plan.items():
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [n for n in names if regex.match(n)]
        if not hits:
            raise ConfigError(f"tensor_parallel_plan: {pattern!r} names no module of {type(model).__name__}; "
                              "check the path (for example 'layers.*.mlp.up_proj')")
        found.update((n, style) for n in hits)
    return found


def _check_sizes(model: nn.Module, modules: dict[str, str], tp: int) -> None:
    """Heads and every split dimension divisible by tp (one line naming what is not)."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"tensor_parallel_size={tp} does not divide {type(model).__name__}'s "
                              f"{field}={heads}: attention splits by heads; choose a tensor_parallel_size "
                              "that divides it")
    for path, style in modules.items():
        module = model.get_submodule(path)
        weight = getattr(module, "weight", None)
        if weight is None or style == "replicate":
            continue
        dim = 1 if style == "rowwise" else 0  # nn.Linear's weight is (out, in); Embedding's (rows, dim)
        dim = 1 - dim if _transposed(module) else dim  # Conv1D's is (in, out)
        if weight.shape[dim] % (tp * (3 if style == "colwise_qkv" else 1)):
            raise ConfigError(f"tensor_parallel_size={tp} does not divide {path}'s {tuple(weight.shape)} "
                              f"weight ({style}: dimension {dim}); choose a tensor_parallel_size that "
                              "divides it")


def _check_ties(model: nn.Module, modules: dict[str, str]) -> None:
    """A parameter shared by two modules (tied embeddings: GPT-2's wte and lm_head) is one
    tensor: splitting it in one module and not the same way in the other would untie them, each
    module training its own copy. Refused in one line, naming both."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
    for paths in owners.values():
        held = {p.rsplit(".", 1)[0] if "." in p else "": p for p in paths}
        styles = {module: modules.get(module, "not split") for module in held}
        if len(paths) > 1 and len(set(styles.values())) > 1:
            said = " and ".join(f"{m} ({s})" for m, s in styles.items())
            raise ConfigError(f"tensor_parallel_plan: {said} share one weight (tied); splitting it in one "
                              "would untie them: leave both whole (or untie them first: "
                              "tie_word_embeddings=False)")


def _check_partners(modules: dict[str, str]) -> None:
    """A colwise layer leaves its output split over the tp ranks: a rowwise layer in the same
    sublayer (its parent's modules; never the model itself, where a head sits) must take it,
    and a rowwise layer needs a colwise one there to split its input. Without, torch fails deep
    in a matmul, or (a head of few outputs) trains on part of them with only a broadcasting
    warning. Refused in one line naming the layer and the fix."""
    def partners(path: str, styles: tuple[str, ...]) -> list[str]:
        parent = _parent(path)
        return [p for p, s in modules.items() if s in styles and parent and p.startswith(parent + ".")]

    for path, style in modules.items():
        where = _parent(path) or f"the model ({path} is not inside a sublayer)"
        if style in ("colwise", "colwise_qkv") and not partners(path, ("rowwise",)):
            raise ConfigError(f"tensor_parallel_plan: {path} is {style} (its output stays split over the tp "
                              f"ranks) but {where} has no rowwise layer to take it: plan its partner rowwise "
                              "(an MLP's down projection, attention's output), or make it "
                              "colwise_gather_output (a head: colwise_loss_parallel)")
        if style == "rowwise" and not partners(path, ("colwise", "colwise_qkv")):
            raise ConfigError(f"tensor_parallel_plan: {path} is rowwise (it takes its input split over the "
                              f"tp ranks) but {where} has no colwise layer to split it: plan its partner "
                              "colwise, or leave it whole")


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], mesh: DeviceMesh, *,
                          sequence_parallel: bool = False) -> dict[str, str]:
    """Split `model`'s planned modules over the 1-D tp `mesh` in place (weights from tp rank 0),
    with `sequence_parallel` the activations between them over the sequence (module docstring);
    returns the module paths split, with their styles. Refuses, before changing anything, a
    model without a plan, a plan naming no module, and sizes tp does not divide."""
    tp = mesh.size()
    if not plan:
        raise ConfigError(f"tensor_parallel_size={tp}: {type(model).__name__} has no tensor-parallel plan "
                          "(transformers models carry one as config.base_model_tp_plan); give one as "
                          "tensor_parallel_plan: {'layers.*.mlp.up_proj': 'colwise', ...}")
    modules = _matches(plan, model)
    _check_ties(model, modules)
    layout = _sequence_layout(model, modules) if sequence_parallel else None
    styles = {path: _style(style, model.get_submodule(path), sequence_parallel and style in _SEQUENCE_STYLES)
              for path, style in modules.items()}
    _check_sizes(model, modules, tp)
    _check_partners(modules)
    parallelize_module(model, mesh, {p: s for p, s in styles.items() if s is not None})
    for path, style in modules.items():
        if style == "colwise_qkv" and "." in path:  # its attention now sees its own heads only
            attention = model.get_submodule(path.rsplit(".", 1)[0])
            for name in _LOCAL_SIZES:
                if isinstance(getattr(attention, name, None), int):
                    setattr(attention, name, getattr(attention, name) // tp)
    if layout is not None:
        _split_sequence(model, layout, mesh)
    return modules


# -- sequence parallelism: the activations between the split layers split over the sequence -------
_SEQUENCE_STYLES = ("colwise", "rowwise", "colwise_qkv")


class _Layout:
    """Where sequence parallelism cuts a model: its blocks (the residual stream enters the first
    split and leaves the last gathered), the sublayers that gather their input (the colwise
    layers' parents) and the norms that run on this rank's tokens."""

    def __init__(self, blocks: list[str], sublayers: list[str], norms: list[str]) -> None:
        self.blocks, self.sublayers, self.norms = blocks, sublayers, norms


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _sequence_layout(model: nn.Module, modules: dict[str, str]) -> _Layout:
    """The blocks, sublayers and norms of `model` under its plan; refuses (one line) a model whose
    blocks have no attention and MLP modules of their own, or hold other whole parameters."""
    split = [p for p, st in modules.items() if st in _SEQUENCE_STYLES]
    sublayers = sorted({_parent(p) for p, st in modules.items() if st in ("colwise", "colwise_qkv")})
    blocks = sorted({_parent(s) for s in sublayers})
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    nested = [s for s in sublayers if not s or s in blocks]  # a block holding colwise layers itself
    if nested or not blocks or "" in blocks:
        raise ConfigError("sequence_parallel: each block's attention and MLP must be modules of their own "
                          f"holding the colwise layers (found them under {sublayers[:2]}); leave "
                          "sequence_parallel off for this model")
    norms = []
    for block in blocks:
        for name, sub in model.get_submodule(block).named_modules(prefix=block):
            if not sub._parameters or any(name == p or name.startswith(p + ".") for p in split):
                continue
            if "norm" not in type(sub).__name__.lower():
                raise ConfigError(f"sequence_parallel: {name} ({type(sub).__name__}) holds whole "
                                  "parameters between the split layers and is not a norm; leave "
                                  "sequence_parallel off for this model")
            norms.append(name)
    return _Layout(sorted(blocks, key=order.__getitem__), sublayers, norms)


def _split_sequence(model: nn.Module, layout: _Layout, mesh: DeviceMesh) -> None:
    """Hook the cuts of `layout` into `model` (the split layers already reduce-scatter)."""
    group = mesh.get_group()
    parallelize_module(model, mesh, {n: SequenceParallel(use_local_output=True) for n in layout.norms})
    first, last = model.get_submodule(layout.blocks[0]), model.get_submodule(layout.blocks[-1])
    first.register_forward_pre_hook(_on_hidden(_applied(_SeqSplit, group), layout.blocks[0]),
                                    with_kwargs=True)
    last.register_forward_hook(_gather_output(group))
    for name in layout.sublayers:
        model.get_submodule(name).register_forward_pre_hook(_on_hidden(_applied(_SeqGather, group), name),
                                                            with_kwargs=True)


def trial_sequence_shapes(model: nn.Module, plan: dict[str, str], tp: int, batch: Any) -> None:
    """Refuse, before `model` is changed, a model whose planned blocks or sublayers would get no
    sequence to split: its forward on `batch` run on a meta-device copy (no memory, no compute,
    no collective), with the shape checks the cuts make, so the refusal comes at prepare, not at
    the first forward. `batch` (its tensors on the meta device) is called as a script calls it: a
    mapping as keywords, a tensor as the argument, a tuple's first item. A model that cannot run
    on the meta device is left to those checks at its first forward (they refuse the same line
    there). The plan's own
    refusals come first, in `apply_tensor_parallel`'s order (no plan: left to it)."""
    if not plan:
        return
    modules = _matches(plan, model)
    _check_ties(model, modules)
    layout = _sequence_layout(model, modules)
    try:
        ghost = _meta_copy(model)
    except Exception:  # noqa: BLE001 - an attribute deepcopy cannot take: the first forward checks
        return

    def length(x: torch.Tensor) -> torch.Tensor:  # (the first block's split: `_chunk`)
        _check_length(x, tp)
        return x

    ghost.get_submodule(layout.blocks[0]).register_forward_pre_hook(_on_hidden(length, layout.blocks[0]),
                                                                    with_kwargs=True)
    for name in layout.sublayers:
        ghost.get_submodule(name).register_forward_pre_hook(_on_hidden(lambda x: x, name), with_kwargs=True)
    try:
        with torch.no_grad():
            if isinstance(batch, Mapping):
                ghost(**batch)
            else:
                ghost(batch[0] if isinstance(batch, (list, tuple)) else batch)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - not runnable on meta (data-dependent code): checked at first forward
        return


def _meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s structure with every parameter and buffer on the meta device (nothing copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _applied(fn: type[torch.autograd.Function], group: dist.ProcessGroup) -> Callable[[torch.Tensor], Any]:
    return lambda x: fn.apply(x, group)


def _on_hidden(fn: Callable[[torch.Tensor], Any], name: str) -> Any:
    """A forward pre-hook applying `fn` to module `name`'s hidden states (first argument or
    `hidden_states=`), which must be (batch, sequence, ...): every tp rank sees the same shape,
    so a refusal here is the same one line on each, before any collective of this module."""
    def hidden(x: Any) -> Any:
        if not torch.is_tensor(x) or x.dim() < 3:
            shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ConfigError(f"sequence_parallel: {name} gets hidden states of shape {shape}, with no "
                              "sequence dimension (batch, sequence, hidden) to split; leave "
                              "sequence_parallel off for this model, or plan only layers that see a sequence")
        return fn(x)

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (hidden(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": hidden(kwargs["hidden_states"])}
        raise ConfigError("sequence_parallel: a block or sublayer was called without its hidden states as "
                          "the first argument or hidden_states=; leave sequence_parallel off for this model")
    return hook


def _gather_output(group: dist.ProcessGroup) -> Any:
    def hook(_module: nn.Module, _args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (_SeqGatherWhole.apply(out[0], group), *out[1:])  # type: ignore[no-untyped-call]
        return _SeqGatherWhole.apply(out, group)  # type: ignore[no-untyped-call]
    return hook


def _check_length(x: torch.Tensor, tp: int) -> None:
    """The sequence (dimension 1) must split into `tp` equal parts."""
    if x.size(1) % tp:
        raise ConfigError(f"sequence_parallel: the sequence length {x.size(1)} does not divide by "
                          f"tensor_parallel_size={tp}; pad the batches to a multiple of it")


def _chunk(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part of `x`'s sequence (dimension 1)."""
    size = dist.get_world_size(group)
    _check_length(x, size)
    return x.chunk(size, dim=1)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence from every rank's part, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over the tp ranks of `x`, this rank's part of the sequence only."""
    size = dist.get_world_size(group)
    _check_length(x, size)
    parts = [c.contiguous() for c in x.chunk(size, dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _SeqSplit(torch.autograd.Function):
    """Into the first block: the whole (replicated) hidden states -> this rank's tokens; in
    backward every rank's gradient gathered (the layers below run whole on every rank)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return _chunk(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None  # type: ignore[attr-defined]


class _SeqGatherWhole(torch.autograd.Function):
    """Out of the last block: every rank's tokens gathered; in backward this rank's part of the
    gradient (the layers above run whole on every rank, so theirs is the same on each)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _chunk(grad, ctx.group), None  # type: ignore[attr-defined]


class _SeqGather(torch.autograd.Function):
    """Into a sublayer: every rank's tokens gathered for its colwise layers; in backward the
    gradient summed over the tp ranks (each computed it from its own columns) and scattered."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group), None  # type: ignore[attr-defined]


class _ReduceScatter(torch.autograd.Function):
    """Out of a rowwise layer under sequence parallelism: the partial sums reduce-scattered over
    the sequence; in backward the gradient of this rank's tokens gathered."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None  # type: ignore[attr-defined]


# -- colwise and rowwise computed on local shards (Conv1D, fused projections) ----------------------
class _GradAllReduce(torch.autograd.Function):
    """Identity forward; the gradient summed over the tp group in backward (the input of a
    colwise layer: every rank's columns contribute to it)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # type: ignore[attr-defined]
        return grad, None


class _AllReduce(torch.autograd.Function):
    """The output of a rowwise layer: partial sums all-reduced over the tp group in forward; the
    gradient (the same on every rank) passes through."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's weight and bias as this rank's local shards (whole where not split)."""
    def local(t: object) -> torch.Tensor | None:
        return t.to_local() if isinstance(t, DTensor) else t if isinstance(t, torch.Tensor) else None
    weight = local(module.weight)
    assert weight is not None
    return weight, local(getattr(module, "bias", None))


def _group(module: nn.Module) -> dist.ProcessGroup:
    group = module.__dict__["_tp_group"]
    assert isinstance(group, dist.ProcessGroup)
    return group


def _colwise_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    group = _group(self)
    if not self.__dict__["_tp_sequence"]:  # (sequence parallel: its sublayer's gather sums it)
        x = _GradAllReduce.apply(x, group)  # type: ignore[no-untyped-call]
    weight, bias = _weights(self)
    if bias is not None and not isinstance(self.bias, DTensor):  # a fused projection's whole bias:
        # this rank's third of each of q, k, v; its gradient (nonzero on this rank's slices only)
        # summed over the tp group in backward, so every rank's whole bias gets the whole gradient
        bias = _GradAllReduce.apply(bias, group)  # type: ignore[no-untyped-call]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        bias = bias.view(3, size, -1)[:, rank].reshape(-1)
    if not _transposed(self):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.size(-1))
    out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return out.view(*x.shape[:-1], weight.size(1))


def _rowwise_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight, bias = _weights(self)
    group = _group(self)
    partial = x @ weight if _transposed(self) else F.linear(x, weight)
    if not self.__dict__["_tp_sequence"]:
        out: torch.Tensor = _AllReduce.apply(partial, group)  # type: ignore[no-untyped-call]
        return out + bias if bias is not None else out  # the bias is whole: added once
    scattered: torch.Tensor = _ReduceScatter.apply(partial, group)  # type: ignore[no-untyped-call]
    if bias is None:
        return scattered
    # added to this rank's tokens only: its gradient summed over the tp ranks in backward
    whole: torch.Tensor = _GradAllReduce.apply(bias, group)  # type: ignore[no-untyped-call]
    return scattered + whole


_CLASSES: dict[tuple[type, str], type] = {}


def _local_class(cls: type, kind: str) -> type:
    """`cls` with the forward of `kind` (as FSDP2 swaps a module's class to add its own)."""
    key = (cls, kind)
    if key not in _CLASSES:
        forward = _rowwise_forward if kind == "rowwise" else _colwise_forward
        _CLASSES[key] = type(f"TensorParallel{cls.__name__}", (cls,), {"forward": forward})
    return _CLASSES[key]


class _LocalSplit(ParallelStyle):
    """colwise, rowwise or colwise_qkv for a layer torch's styles do not take: GPT-2's Conv1D
    (weight (in, out)) and fused query/key/value projections. The weight (and a plain colwise
    bias) become DTensors on the tp mesh; the forward computes on the local shards. A fused projection's
    output features are split per third (`strided_shard(dim, 3)`), so each rank's
    slice is [its queries, its keys, its values] while the DTensor's global layout stays the
    model's own (checkpoints, exports and FSDP see the ordinary weight). Communication: colwise
    all-reduces its input's gradient in backward, rowwise its output in forward."""

    def __init__(self, kind: str, sequence: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.sequence = sequence  # sequence parallel: the input gathered, the output scattered outside

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_dim = 1 if _transposed(module) else 0  # the weight's output-feature dimension
        fused = self.kind == "colwise_qkv"
        rowwise = self.kind == "rowwise"
        split: Placement = (Shard(1 - out_dim) if rowwise
                            else strided_shard(out_dim, 3) if fused else Shard(out_dim))
        weight, bias = _weights(module)
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight, device_mesh, [split])))
        # a colwise bias is split with its weight; a fused projection's stays whole (3 x its width:
        # FSDP's split of dim 0 over a per-third split of the same dim is no layout DTensor gathers
        # back in order), and so does a rowwise one (added once, after the all-reduce)
        if bias is not None and not rowwise and not fused:
            module.register_parameter("bias", nn.Parameter(distribute_tensor(bias, device_mesh, [Shard(0)])))
        module.__dict__["_tp_group"] = device_mesh.get_group()
        module.__dict__["_tp_sequence"] = self.sequence
        module.__class__ = _local_class(type(module), "rowwise" if rowwise else "colwise")
        return module


def clip_over_meshes(params: Sequence[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """`clip_grad_norm_` for parameters on several meshes (tp-split weights on the (dp, tp) mesh,
    whole ones on the dp mesh only, under FSDP2): each mesh's gradient norm in full (its shards'
    norms all-reduced), the norm of those norms, one clip coefficient for every gradient."""
    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        groups.setdefault(id(getattr(p, "device_mesh", None)), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        full = getattr(norm, "full_tensor", None)
        norms.append(full() if full is not None else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for grads in groups.values():
                for grad in grads:
                    grad.mul_(coef)
    return total
