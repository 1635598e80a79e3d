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
  replicate               left whole on every tp rank (a name kept for plans that list it).
A transformers model brings its own (`config.base_model_tp_plan`, under the base model's prefix:
Llama, Mistral, Qwen, Gemma, ...); a user gives one as `tensor_parallel_plan`. Attention layers
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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ..config.tree import TP_STYLES, ConfigError


def _style(name: str) -> ParallelStyle | None:
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
    """The plan for `model`: the user's `given` one, else the transformers model's own (its base
    model's `base_model_tp_plan`, paths prefixed with the base model's attribute); {} when none."""
    if given:
        return dict(given)
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
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
        if weight.shape[dim] % tp:
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
    styles = {path: _style(style) for path, style in modules.items()}
    _check_sizes(model, modules, tp)
    parallelize_module(model, mesh, {p: s for p, s in styles.items() if s is not None})
    return modules


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
