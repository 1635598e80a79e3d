"""Each parallelism is a step: a function that applies one transform to a model on its view of
the run's mesh (`distributed.mesh.ParallelDims`), composed here, in one place, in torchtitan's
order:

  1. model parallelism on the `tp` view (`model_parallel_step`): the tensor-parallel plan (a
     transformers model's own, or `tensor_parallel_plan`) with sequence parallelism; or the
     user's own `parallelize(model, dims)`; or nothing, where the model arrives split already
     (transformers' `from_pretrained(tp_plan="auto", device_mesh=...)`) on a tp group equal to
     this run's: it is never split twice;
  1b. expert parallelism on the `ep` view (`expert_parallel_step`): each mixture-of-experts
     layer's experts split over the group, tokens dispatched with all-to-alls; the data-parallel
     step leaves the expert parameters alone (`expert_params`);
  2. context parallelism on the `cp` view (`context_parallel_step`): the batch split along the
     sequence at the model's door, attention over the whole sequence (ring or Ulysses), the whole
     sequence's loss;
  2b. tiled MLP and tiled loss (`tiling_step`; on by default under context parallelism): the
     MLP intermediate and the logits computed a tile of tokens at a time;
  3. activation checkpointing, per block (`blocks_step`);
  4. compile, per block (`blocks_step`: each replaces the block's own `forward`; full and
     selective checkpointing compile with the block, offload's hooks stay outside);
  5. the data-parallel step: FSDP2 on the `fsdp` view, DDP, or a DeepSpeed engine
     (`Strategy.setup_model`, run by the session, which knows how the model was built).
A backend that applies a step itself names it in `Strategy.own_steps` (DeepSpeed's AutoTP splits
the layers when its engine is built). A new dimension is a new step here and a new view of the
mesh, never a flag on a strategy.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.tree import BlocksConfig, ConfigError, ParallelismConfig
from ..distributed.mesh import ParallelDims
from ..weights.record import recipes_kept
from .blocks import apply_activation_checkpointing, find_blocks
from .compile import apply_compile, compile_options
from .context_parallel import context_parallel_step
from .expert_parallel import expert_parallel_step
from .tensor_parallel import apply_tensor_parallel, model_plan, trial_sequence_shapes
from .tiling import tiling_step

log = logging.getLogger("shardwise")


def parallelize(model: nn.Module, dims: ParallelDims, section: ParallelismConfig, blocks: BlocksConfig,
                *, own_steps: frozenset[str] = frozenset()) -> None:
    """Steps 1-4 on `model`, in place (step 5 is the strategy's `setup_model`)."""
    if "tp" not in own_steps:
        model_parallel_step(model, dims, section)
    with recipes_kept(model):  # (an init_empty() model: its split experts keep their init)
        expert_parallel_step(model, dims)
    context_parallel_step(model, dims, section.cp_method)
    tiling_step(model, blocks, context_parallel=dims.cp > 1)
    blocks_step(model, blocks)


def model_parallel_step(model: nn.Module, dims: ParallelDims, section: ParallelismConfig) -> None:
    """Split `model` over its tensor-parallel group: the user's function, or the plan."""
    user = resolve_parallelize(section.parallelize)
    if _split_already(model, dims):
        if user is not None:
            raise ConfigError("parallelize: this model arrived split already (its parameters are DTensors, "
                              "e.g. from_pretrained(tp_plan='auto')); drop parallelize or load it whole")
        return
    if user is not None:
        with recipes_kept(model):
            out = user(model, dims)
        if out is not None and out is not model:
            raise ConfigError(f"parallelize={section.parallelize!r} returned a new object; it must split "
                              "the model it is given in place (and return None or that model)")
        return
    if dims.tp == 1:
        return
    with recipes_kept(model):  # (an init_empty() model: its split parameters keep their init)
        apply_tensor_parallel(model, model_plan(model, section.tp_plan), dims.tp_mesh,
                              sequence_parallel=section.sequence_parallel)


def model_parallel_trial(model: nn.Module, dims: ParallelDims, section: ParallelismConfig,
                         samples: Callable[[], Any]) -> None:
    """Before step 1 changes `model`: under sequence parallelism, run its forward on the meta
    device with `samples()` (the DataLoader's first samples, on the meta device; None: none to
    read, and then no trial) and refuse in one line a planned layer that would get no sequence to
    split (`tensor_parallel.trial_sequence_shapes`). Nothing is read for a run without it."""
    if dims.tp == 1 or not section.sequence_parallel or section.parallelize is not None:
        return
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return  # split already: step 1 leaves it as it is
    batch = samples()
    if batch is not None:
        trial_sequence_shapes(model, model_plan(model, section.tp_plan), dims.tp, batch)


def resolve_parallelize(value: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The user's `parallelize(model, dims)`: a callable, or a "module:function" name imported here
    (refused in one line when it cannot be)."""
    if value is None or callable(value):
        return value
    module, _, name = value.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"parallelize={value!r}: cannot import {name!r} from {module!r} ({err}); give "
                          "'module:function' of an importable module") from None
    if not callable(fn):
        raise ConfigError(f"parallelize={value!r} is not a function")
    return fn  # type: ignore[no-any-return]


def _split_already(model: nn.Module, dims: ParallelDims) -> bool:
    """The model's parameters are DTensors already (transformers' `tp_plan="auto"`): they must lie
    on this run's tp group, else refused in one line (a second split would be silently wrong)."""
    split = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not split:
        return False
    if any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        raise ConfigError("prepare: this model is sharded already by FSDP (transformers' fsdp_size, or "
                          "fully_shard): load it unsharded and let the strategy shard it")
    mesh = split[0].device_mesh
    ranks = sorted(int(r) for r in mesh.mesh.reshape(-1).tolist())
    rank = dist.get_rank() if dist.is_initialized() else 0
    ours = sorted(dims.group_of("tp", rank))
    if mesh.ndim != 1 or ranks != ours:  # (said alike on every process: the first tp group, not its own)
        raise ConfigError(f"prepare: this model arrived split over processes {ranks} (its parameters are "
                          f"DTensors, e.g. from_pretrained(tp_plan='auto')), but this run's tensor-parallel "
                          f"groups are {dims.tp} consecutive process(es) ({dims.group_of('tp', 0)}, ...; "
                          f"tensor_parallel_size={dims.tp}): set tensor_parallel_size "
                          f"(ParallelismConfig(tp_size=...)) to the split's size")
    log.info("prepare: the model arrived split by its own plan over tp group %s: kept as it is", ours)
    return True


def blocks_step(model: nn.Module, cfg: BlocksConfig) -> None:
    """Activation checkpointing and compilation, per block, before sharding: each replaces the
    block's own `forward` (its module tree and parameter names stay as they are)."""
    mode, compiling = str(cfg.activation_checkpointing), cfg.compile
    if mode == "none" and not compiling:
        return
    blocks = find_blocks(model, cfg.wrap)
    if mode != "none":
        _no_kv_cache(model)
    # offload's saved-tensor hooks stay outside the compiled graph (they wrap the compiled
    # forward); full and selective checkpointing are compiled with the block (dynamo traces
    # torch's checkpoint and its selective policy as one graph)
    if compiling and mode == "offload":
        apply_compile(blocks or [model], compile_options(cfg))
    if mode != "none":
        apply_activation_checkpointing(blocks, mode, every=cfg.activation_checkpointing_every)
    if compiling and mode != "offload":
        apply_compile(blocks or [model], compile_options(cfg))


def _no_kv_cache(model: nn.Module) -> None:
    """A `transformers` model recomputing its blocks in backward must not cache keys and values:
    the recompute would append to the cache, which then outlives the step."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
