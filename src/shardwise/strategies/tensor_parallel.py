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

Memory: each tp rank holds 1/tp of every planned weight (and its gradients and optimizer state);
the data-parallel strategy then shards what each rank holds over the data-parallel ranks
(zero2/zero3: FSDP2 over the dp mesh, after this). Communication per block: the rowwise layers'
all-reduce of the activations (batch x sequence x hidden) in forward and again in backward.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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


def _style(name: str, module: nn.Module) -> ParallelStyle | None:
    if name == "colwise_qkv" or (name in ("colwise", "rowwise") and _transposed(module)):
        return _LocalSplit(name)
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


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], mesh: DeviceMesh) -> dict[str, str]:
    """Split `model`'s planned modules over the 1-D tp `mesh` in place (weights from tp rank 0);
    returns the module paths split, with their styles. Refuses, before changing anything, a
    model without a plan, a plan naming no module, and sizes tp does not divide."""
    tp = mesh.size()
    if not plan:
        raise ConfigError(f"tensor_parallel_size={tp}: {type(model).__name__} has no tensor-parallel plan "
                          "(transformers models carry one as config.base_model_tp_plan); give one as "
                          "tensor_parallel_plan: {'layers.*.mlp.up_proj': 'colwise', ...}")
    modules = _matches(plan, model)
    styles = {path: _style(style, model.get_submodule(path)) for path, style in modules.items()}
    _check_sizes(model, modules, tp)
    parallelize_module(model, mesh, {p: s for p, s in styles.items() if s is not None})
    for path, style in modules.items():
        if style == "colwise_qkv" and "." in path:  # its attention now sees its own heads only
            attention = model.get_submodule(path.rsplit(".", 1)[0])
            for name in _LOCAL_SIZES:
                if isinstance(getattr(attention, name, None), int):
                    setattr(attention, name, getattr(attention, name) // tp)
    return modules


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
    partial = x @ weight if _transposed(self) else F.linear(x, weight)
    out: torch.Tensor = _AllReduce.apply(partial, _group(self))  # type: ignore[no-untyped-call]
    return out + bias if bias is not None else out  # the bias is whole: added once


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

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

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
        module.__class__ = _local_class(type(module), "rowwise" if rowwise else "colwise")
        return module


def check_tensor_parallel(tp: int, world: int, local_world: int) -> int:
    """`tensor_parallel_size` at this run's size: it divides the world, and, across nodes, the
    processes of a node (its all-reduces, one per rowwise layer, stay within a node)."""
    if tp == 1:
        return 1
    if world % tp:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the {world} processes of this run; "
                          "choose a divisor")
    if world > local_world and local_world % tp:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the {local_world} processes per node: "
                          "its all-reduces would cross nodes; choose a divisor of the processes per node")
    return tp


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
