"""`strategy="auto"`: at the first `prepare`, plan for this run and take the fastest plan that fits.

The planner (`shardwise.plan`) traces the user's model on fake tensors through every strategy
at the real world size and per-device batch, against the real device memory (a GPU's total
memory; on CPU processes, this machine's RAM shared by its local processes). Every rank plans
the same inputs deterministically and without collectives, so every rank makes the same choice.
`auto` picks the strategy and the offload; activation checkpointing stays the user's setting
(its mode is planned on every strategy), an offload the user set restricts the choice to plans
with it, and a `shard_group_size` the user set is planned as set (hybrid sharding: per-rank
state cut by the group, not the world). A `tensor_parallel_size` the user set is planned as set
(every strategy and offload with it, `sequence_parallel` too), or refused in one line when none
fits. An `expert_parallel_size` the user set is planned as set, on zero1, zero2 and zero3
(the strategies that split experts) with every offload. Otherwise only when no plan without tensor
parallelism fits, and the model has a
tensor-parallel plan, does `auto` plan every strategy and offload again with
tensor_parallel_size 2, 4 and 8 (those dividing the processes of a node), the smallest first,
and take the first size where one fits: its `tensor_parallel_size` goes into the config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

import torch
from torch import nn

from ..config.parallelism import resolve_shard_group
from ..config.tree import ConfigError, EngineConfig, offload_spec
from ..distributed.world import DistInfo

log = logging.getLogger("shardwise")


def device_memory(info: DistInfo) -> int:
    """Bytes one process may use: its GPU's memory, or its share of this machine's RAM."""
    if info.device.type == "cuda":
        return int(torch.cuda.get_device_properties(info.device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram // max(1, info.local_world_size))


def sample_batch(loader: Any) -> Any:
    """The first `batch_size` samples of the loader's dataset, collated as the loader would
    (read by index: the sampler and its random state are untouched)."""
    dataset = loader.dataset
    indexable = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if loader.batch_size is None or not indexable:
        raise ConfigError(
            "strategy='auto' reads one batch by index to plan, which needs a map-style dataset and a "
            "DataLoader batch_size; name the strategy instead (see `shardwise plan`)"
        )
    n = min(loader.batch_size, len(dataset))
    return loader.collate_fn([dataset[i] for i in range(n)])


TP_SIZES = (2, 4, 8)


def _with_tensor_parallel(model: nn.Module, batch: Any, request: Any, info: DistInfo,
                          sizes: tuple[int, ...] = TP_SIZES, sequence_parallel: bool = False) -> Any:
    """The first plan, over tp in `sizes` (2, 4, 8) dividing the processes of a node, whose
    tensor-parallel candidates (`tp_candidates` of the request's) have one that fits; None when
    none does or the model has no tensor-parallel plan."""
    from ..strategies.tensor_parallel import model_plan
    from . import plan_module
    from .request import tp_candidates

    if not model_plan(model, None):
        return None
    per_node = max(1, info.local_world_size) if info.world_size % max(1, info.local_world_size) == 0 else 1
    for tp in (t for t in sizes if per_node % t == 0 and info.world_size % t == 0):
        cands = tp_candidates(request.chosen(), tp, sequence_parallel)
        if not cands:
            return None
        plan = plan_module(model, batch, dataclasses.replace(request, candidates=cands))
        if plan.best is not None:
            return plan
    return None


def choose(
    cfg: EngineConfig, info: DistInfo, models: list[nn.Module], loaders: list[Any]
) -> tuple[EngineConfig, Any]:
    """The config with `strategy` (and `offload`) chosen by the planner, and the plan."""
    from . import CANDIDATES, PlanRequest, plan_module

    if len(models) != 1 or not loaders:
        raise ConfigError(
            "strategy='auto' plans one model at its per-device batch: pass exactly one model and its "
            f"DataLoader to the same prepare() call (got {len(models)} model(s), "
            f"{len(loaders)} DataLoader(s))"
        )
    loader = loaders[0]
    # an offload the user set restricts the choice to plans with it
    restrict = offload_spec(cfg.sharding.offload).any
    # a shard_group_size the user set (hybrid sharding) is planned as set, for every sharding plan
    group = resolve_shard_group(cfg.sharding.shard_group_size, info.world_size, info.local_world_size)
    hybrid = group if group < info.world_size else None
    sharding = {c: hybrid if c.strategy_spec.shards_optimizer else None for c in CANDIDATES}
    # the config's activation checkpointing (any mode), on every strategy
    mode, every = str(cfg.blocks.activation_checkpointing), cfg.blocks.activation_checkpointing_every
    candidates = [dataclasses.replace(c, shard_group_size=sharding[c], activation_checkpointing=mode,
                                      activation_checkpointing_every=every)
                  for c in CANDIDATES
                  if not c.checkpointed and (not restrict or c.offload == cfg.sharding.offload)]
    local = max(1, info.local_world_size)
    request = PlanRequest(
        world_size=info.world_size, nodes=info.world_size // local if info.world_size % local == 0 else 1,
        device_memory=device_memory(info), batch=loader.batch_size,
        device="cuda" if info.device.type == "cuda" else "cpu", precision=cfg.sharding.precision,
        candidates=candidates, activation_checkpointing=mode, activation_checkpointing_every=every,
        wrap=cfg.blocks.wrap, checkpoint_async=cfg.checkpointing.background,
    )
    batch = sample_batch(loader)
    asked_tp, asked_ep = cfg.parallelism.tp, cfg.parallelism.ep
    if asked_ep > 1:  # the user's expert parallelism is planned as set, on the strategies that split experts
        plan = plan_module(models[0], batch, dataclasses.replace(request, candidates=[
            dataclasses.replace(c, expert_parallel_size=asked_ep) for c in candidates
            if c.strategy_spec.shards_optimizer and c.shard_group_size is None]))
        if plan.best is None:
            raise ConfigError(f"strategy='auto' with expert_parallel_size={asked_ep}: no strategy fits: "
                              f"{plan.why}; see `shardwise plan --expert-parallel-size {asked_ep}`")
    elif asked_tp > 1:  # the user's tensor parallelism is planned as set, with every strategy and offload
        plan = _with_tensor_parallel(models[0], batch, request, info, (asked_tp,),
                                     cfg.parallelism.sequence_parallel)
        if plan is None or plan.best is None:
            raise ConfigError(
                f"strategy='auto' with tensor_parallel_size={asked_tp}: no strategy fits with tensor "
                f"parallelism {asked_tp} (or the model has no tensor-parallel plan); name the strategy, "
                f"or see `shardwise plan --tensor-parallel-size {asked_tp}`"
            )
    else:
        plan = plan_module(models[0], batch, request)
    if plan.best is None:
        plan = _with_tensor_parallel(models[0], batch, request, info) or plan
    if plan.best is None:
        raise ConfigError(f"strategy='auto': no strategy fits: {plan.why}")
    chosen = plan.best.settings()
    tp = chosen.get("tensor_parallel_size", 1)
    # the plan's group (in processes, `Plan.settings`) under tp; without, the user's own setting
    shard_group = cfg.sharding.shard_group_size if tp == 1 else chosen.get("shard_group_size")
    out = cfg.with_keys(strategy=chosen["strategy"], offload=chosen["offload"], tensor_parallel_size=tp,
                        shard_group_size=shard_group)
    message = f"shardwise: strategy='auto' chose {plan.best.name}: {plan.why}"
    log.info(message)
    if info.is_main:
        print(message, file=sys.stderr, flush=True)
    return out, plan
