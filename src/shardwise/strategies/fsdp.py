"""zero2 and zero3 on FSDP2 (`torch.distributed.fsdp.fully_shard`), with host offload.

Each detected block (a transformer layer) and the root become FSDP units; a unit's parameters
are stored as dim-0 shards (DTensor) and all-gathered just before its forward and backward.
  zero3  reshard after forward: the full block exists only while it computes, so the per-rank
         resting footprint of parameters, gradients (reduce-scattered) and optimizer state is 1/W.
  zero2  keep the gathered parameters from forward to backward (one all-gather per step instead
         of two, at the cost of holding them through the step); gradients and optimizer state
         are still 1/W.
Hybrid sharding (`shard_group_size` G < W): the mesh is 2-D ("dp_replicate", "dp_shard"); FSDP2
shards each unit over its group of G processes (HSDP: all-gathers and reduce-scatters never
leave the group) and all-reduces each reduce-scattered gradient shard across the W/G groups, so
per-rank parameters, gradients and optimizer state are 1/G. On gloo both collectives sum and
FSDP2 divides by W once after them (`set_force_sum_reduction_for_comms`): gloo's reduce-scatter
has no AVG, nor had its all-reduce before torch 2.8.

offload='params' (zero3) keeps parameter shards on the host between uses and runs the optimizer
there (FSDP2's CPUOffloadPolicy). offload='optimizer' is ours: `sharded_optim` moves the
reduce-scattered gradient shards to the host, steps fp32 host masters and copies them back.

A forward no backward follows (under no_grad or inference_mode: evaluation, `generate`) ends
with every unit resharded (`reshard_after_no_grad`): FSDP2 keeps the root's parameters, and
under zero2 every unit's, gathered for a backward that would never come. `generate` keeps every
process calling forward until all are done (`sync_generate`), whatever `synced_gpus` says.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config.tree import ConfigError, EngineConfig, offload_spec
from ..distributed.internals import (
    FSDPReduceScatter as ReduceScatter,  # None before torch 2.8
    local_tensor,
    tree_leaves,
    with_local,
)
from ..distributed.mesh import mesh_groups
from ..distributed.world import DistInfo, backends_of
from ..weights.adapters import is_peft_model, unwrapped
from .base import EmptyModel, OptimizerRunner, Strategy
from .blocks import find_blocks, keep_ties_whole
from .direct_calls import generate_as_forward, route_fsdp_calls
from .expert_parallel import expert_params, expert_units, gradient_sync, sum_over_replicas
from .frozen import for_inference
from .quantized import refuse_sharded_quantized
from .sharded_optim import optimizer_runner


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    blocks: Sequence[nn.Module],
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    """Shard `blocks` (innermost first) and then the root, in place."""
    wanted = {id(b) for b in blocks}
    units = [m for m in reversed(list(model.modules())) if id(m) in wanted] + [model]
    experts = expert_params(model) or None  # split by expert parallelism over the whole group
    # experts split below the sharding group: each module its own unit over its edp mesh (its
    # experts DTensors on the ep mesh: FSDP shards them on the second dimension of the two)
    for unit, edp in expert_units(model):
        fully_shard(unit, mesh=edp, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy)
        scatter = gloo_reduce_scatter(edp)
        if scatter is not None:
            cast(FSDPModule, unit).set_custom_reduce_scatter(scatter)
    # Children before parents (reversed pre-order): a parent unit skips what a child unit owns.
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=experts,
        )
    model.register_forward_hook(_output_in_sight)
    reduce_scatter = gloo_reduce_scatter(mesh)
    if reduce_scatter is not None:
        for unit in units:
            cast(FSDPModule, unit).set_custom_reduce_scatter(reduce_scatter)
    replicate = mesh_groups(mesh)[1]
    if replicate is not None and backends_of(replicate).get(mesh.device_type) == "gloo":
        # FSDP2 averages fp32/bf16 gradients with AVG on both collectives (reduce-scatter in the
        # group, then dist.all_reduce across groups); gloo: SUM on both, one division by W after
        for unit in units:
            cast(FSDPModule, unit).set_force_sum_reduction_for_comms(True)


def _output_in_sight(module: nn.Module, _args: Any, out: Any) -> None:
    """FSDP2 finds a forward's output tensors through torch's pytree (tensors, tuples, lists,
    dicts, namedtuples, transformers' ModelOutput) and hooks the root's backward there: its
    parameters gathered again, its gradients reduced. An output whose every tensor that needs a
    gradient sits inside another object is out of its sight, and its backward would run on freed
    parameters (torch's "setStorage ... storage of size 0"): refused at that forward, in one line,
    the same on every process."""
    if isinstance(out, torch.Tensor) or not torch.is_grad_enabled():
        return
    leaves = tree_leaves(out)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return
    hidden = next((path for leaf in leaves for path in _grad_tensors(leaf, type(leaf).__name__, 3)), None)
    if hidden is not None:
        cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))  # the user's class
        raise ConfigError(
            f"{cls.__name__}.forward returned {type(out).__name__}, whose tensors FSDP cannot find "
            f"({hidden} needs a gradient): sharded backward would run on freed parameters; return a tensor, "
            "tuple, list, dict or namedtuple (or a transformers ModelOutput) holding them")


def _grad_tensors(obj: Any, path: str, depth: int) -> Iterator[str]:
    """Paths (`Out.logits`) of tensors needing a gradient in `obj`'s attributes, `depth` deep."""
    if depth == 0 or isinstance(obj, nn.Module):  # (str, int, None...: no __dict__ below)
        return
    items = getattr(obj, "__dict__", None)
    if not isinstance(items, dict):
        return
    for name, value in items.items():
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                yield f"{path}.{name}"
        else:
            yield from _grad_tensors(value, f"{path}.{name}", depth - 1)


def gloo_reduce_scatter(mesh: DeviceMesh) -> ReduceScatter | None:
    """The gradient reduce-scatter FSDP2 units use on `mesh` (1-D, or 2-D hybrid: within the
    shard group): ours on gloo, else FSDP2's (None)."""
    shard = mesh_groups(mesh)[0]
    if ReduceScatter is None or mesh.device_type != "cpu" or shard.size() == 1:
        return None  # NCCL (device meshes) has a real reduce-scatter
    return _AllReduceScatter() if backends_of(shard).get(mesh.device_type) == "gloo" else None


if ReduceScatter is not None:

    class _AllReduceScatter(ReduceScatter):
        """gloo's reduce-scatter as one in-place all-reduce and a slice.

        gloo has no reduce-scatter of its own, and torch's emulation takes 1.5-2.2x the time of
        an all-reduce of the same buffer (measured on 2 and 4 CPU processes, 1M-25M fp32
        elements), although an all-reduce moves twice the bytes. FSDP2 reduce-scatters each
        unit's gradients every step, so on gloo this unit's flat gradient buffer (FSDP's
        temporary, freed after the call) is all-reduced in place and this rank's chunk is
        copied out, divided by W for an average. `group` is the one FSDP2 reduce-scatters over:
        every process, or under hybrid sharding the shard group (G processes, SUM: FSDP2 then
        all-reduces the chunk across groups and divides). The sums equal gloo's bit for bit on 2
        processes; on more, the order of the additions may differ (fp32 rounding).
        """

        def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False) -> dist.Work | None:
            # op: a ReduceOp or a ReduceOp.RedOpType (FSDP2 passes AVG for fp32/bf16, SUM for fp16)
            world = group.size()
            whole = input_tensor.numel() == output_tensor.numel() * world
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not whole:
                # another reduction (pre-multiplied sums): gloo's own reduce-scatter
                work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
                return cast(dist.Work | None, work)
            dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM, group=group)
            mine = input_tensor.view(world, -1)[group.rank()]
            if op == dist.ReduceOp.AVG:
                torch.div(mine, world, out=output_tensor)
            else:
                output_tensor.copy_(mine)
            return None

    # torch 2.13 renamed reduce_scatter_tensor; older releases only have the old name
    _reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def _model_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's `set_requires_gradient_sync(False)` for the block: backward keeps the units'
    gradients unsharded and local; the next synced backward reduce-scatters their sum once."""
    cast(FSDPModule, model).set_requires_gradient_sync(False)
    gradient_sync(model, False)  # (hybrid sharding's experts, which FSDP leaves alone)
    try:
        yield
    finally:
        cast(FSDPModule, model).set_requires_gradient_sync(True)
        gradient_sync(model, True)


class FSDPStrategy(Strategy):
    """A ZeRO stage on FSDP2. Stages 2 and 3 shard over the `fsdp` view of the mesh. Stages 0
    (ddp) and 1 (zero1) are here under tensor parallelism, whose DTensor parameters torch's DDP
    does not take: every data-parallel rank holds its tp share whole (FSDP2 over groups of one dp
    rank, its layout's dp_shard of 1: DDP's memory, the gradients all-reduced across the
    replicas), and zero1 also splits the optimizer: each data-parallel rank steps 1/dp of its tp
    share's elements, then one all-gather among the replicas (`sharded_optim`)."""

    def __init__(self, cfg: EngineConfig, info: DistInfo, *, stage: int) -> None:
        super().__init__(cfg, info, shards=stage >= 2)
        self.stage = stage
        self.replicas_only = stage <= 1  # (the layout's data-parallel ranks are replicas)
        self.shard_optimizer = stage == 1
        # 1-D over every process, or hybrid's 2-D (dp_replicate, dp_shard): `distributed.mesh`
        self.mesh: DeviceMesh = self.dims.mesh

    def setup_model(self, model: nn.Module, empty: EmptyModel | None = None) -> nn.Module:
        """Shard `model` in FSDP2 units; under zero2 a model prepared for inference only is a
        replica instead, and under zero3 it is sharded like any other (see `strategies.frozen`)."""
        if self.stage < 3 and for_inference(model):
            return self.replicate(model, empty)
        refuse_sharded_quantized(model, f"zero{self.stage}")
        offload_params = offload_spec(self.cfg.sharding.offload).params_on_host
        if offload_params and self.info.device.type != "cpu" and expert_params(model):
            raise ConfigError(f"expert_parallel_size={self.dims.ep} with offload: params on "
                              f"{self.info.device.type}: this version does not offload experts split over "
                              "the whole sharding group; use offload: optimizer, or an expert_parallel_size "
                              "below the sharding group")
        # every process holds process 0's weights already (Session._agree_weights)
        if empty is None and not offload_params:
            model.to(self.info.device)
        blocks = keep_ties_whole(model, find_blocks(model, self.cfg.blocks.wrap))
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        if self.param_dtype is torch.float32:
            mp = MixedPrecisionPolicy()
        offload: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=self.info.device.type == "cuda")
            if offload_params
            else OffloadPolicy()
        )
        apply_fsdp(
            model,
            mesh=self.mesh,
            blocks=blocks,
            reshard_after_forward=self.stage == 3,
            mp_policy=mp,
            offload_policy=offload,
        )
        if empty is not None:  # sharded while empty: each process allocates its shards only
            self.fill(model, empty, "cpu" if offload_params else self.info.device)
        sum_over_replicas(model)  # (hybrid sharding's experts, once their tensors are final)
        if not hasattr(model, "no_sync"):  # DDP's `model.no_sync()`, which scripts call on any prepared model
            model.__dict__["no_sync"] = types.MethodType(_model_no_sync, model)
        model.register_forward_hook(reshard_after_no_grad)  # after FSDP2's own post-forward hook
        reshard = functools.partial(reshard_all, model)
        # submodules called on their own (an encoder from generate) gather the root's parameters
        route_fsdp_calls(model, reshard)
        # `unwrapped` now, not at the first unwrap_model: a save_pretrained of the prepared model
        # is guarded; generate runs as a forward of the root (its parameters gathered throughout)
        sync_generate(unwrapped(model), reshard, generate_as_forward(model))
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not isinstance(model, FSDPModule):
            yield
            return
        with _model_no_sync(model):  # the reduce-scatter waits for the boundary
            yield

    def make_runner(self, optimizer: torch.optim.Optimizer) -> OptimizerRunner:
        offload = offload_spec(self.cfg.sharding.offload)
        if self.shard_optimizer:  # zero1 under tp: the replicas of this tp rank split the elements
            # at one data-parallel rank there are no replicas: its group of one (never None,
            # which the runner takes for every process, the tp ranks holding different parts)
            shard, replicas = self.process_groups()
            return optimizer_runner(optimizer, self.cfg, self.info, partition="flat",
                                    host=offload.optimizer_on_host,
                                    group=replicas if replicas is not None else shard)
        if offload.optimizer_on_host and not offload.params_on_host:
            # optimizer offload: fp32 host masters of this rank's shards step on the host
            return optimizer_runner(optimizer, self.cfg, self.info, partition="local", host=True)
        # the user's optimizer steps the shards in place; where they live on the host
        # (offloaded, or a CPU device) with the fused kernel where its class has one
        return optimizer_runner(optimizer, self.cfg, self.info, partition=None,
                                offloaded=offload.params_on_host, dtensors=True)

    def rebind_state(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A full optimizer-state tensor, cut like its (DTensor) parameter."""
        if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.shape == param.shape:
            # process 0's values, cut on the mesh's device (the scatter's), kept where the
            # parameter's shard lives: the host under offload params, never left on the GPU
            mesh = param.device_mesh
            cut = distribute_tensor(value.to(mesh.device_type), mesh, param.placements)
            return with_local(local_tensor(cut).to(local_tensor(param).device), param)
        return value

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # collective: all ranks gather
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if self.info.is_main else {}


def reshard_all(model: nn.Module) -> None:
    """Every FSDP2 unit of `model` back to its shard (a no-op for a unit already resharded)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def reshard_after_no_grad(model: nn.Module, args: Any, output: Any) -> None:
    """The root's forward hook: a forward under no_grad has no backward to free what it gathered.
    FSDP2 leaves the root's units gathered after forward (the backward needs them first), and
    zero2's blocks too; without a backward they would stay so until the next training step."""
    if not torch.is_grad_enabled():
        reshard_all(model)


_SYNCED = "_shardwise_synced_generate"  # marks a generate `sync_generate` put on an instance


def sync_generate(module: nn.Module, reshard: Callable[[], None],
                  inner: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda g: g) -> None:
    """Give `module` (a sharded model, whose forward is collective) a `generate` that cannot
    desynchronise the processes, and that ends holding only the shard (`reshard`).

    A rank that finishes its sequences early and stops calling forward leaves the others waiting
    in the all-gather of their next forward until the collective timeout. transformers' own
    remedy, `synced_gpus=True` (every process keeps running forward until all are done), is
    forced here for a transformers model (or a peft model of one), whatever the caller passed.
    `inner` wraps the model's own generate first.
    """
    generate = getattr(module, "generate", None)
    if not callable(generate) or getattr(generate, _SYNCED, False):
        return
    generate = inner(generate)  # (FSDP2: counted as a forward of the root, `direct_calls`)
    sync = _is_transformers_generator(module)

    @functools.wraps(generate)
    def synced(*args: Any, **kwargs: Any) -> Any:
        if sync and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["synced_gpus"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            reshard()

    setattr(synced, _SYNCED, True)
    module.__dict__["generate"] = synced  # the instance only; the class stays as it is


def _is_transformers_generator(module: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    get_base = getattr(module, "get_base_model", None)
    base = get_base() if is_peft_model(module) and callable(get_base) else module
    return tf is not None and isinstance(base, tf.GenerationMixin)
