"""Expert parallelism, the mesh's `ep` step: each mixture-of-experts layer's experts split over
the ranks of the expert-parallel group, every token sent to the ranks that own its chosen experts
and back with two all-to-alls (dropless: no token is dropped, so the layer computes what one
process computes).

transformers 5 fuses a layer's experts into one module (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) whose forward `(hidden, top_k_index, top_k_weights)` is picked from a registry
(`ALL_EXPERTS_FUNCTIONS`, by `config._experts_implementation`). This step registers a dispatching
implementation there ("shardwise_ep") and points the model's config at it, without copying model
code: the router, its top-k, its load-balancing loss and any shared expert (Qwen2-MoE) run as they
are, on every rank's own tokens.

The experts' two parameters become DTensors sharded on dimension 0 (the expert index) over the
expert-parallel group's mesh, so a checkpoint stores whole experts (DCP reshards them to any ep
size or to a plain strategy), the gradient norm counts each expert once, and the optimizer steps
each rank's experts only. The data-parallel step leaves them alone (`expert_params`): no all-gather
of experts, ever. Their gradients arrive through the all-to-all's backward as the sum over every
rank's tokens, so they are divided by the data-parallel size (`_Divided`), as FSDP divides the
others (the gradient of the mean of the ranks' losses).

At ep below the sharding group the ranks holding the same experts shard them further (the
data-parallel step's FSDP units over the edp mesh, as torchtitan's efsdp); under zero1, whose
data-parallel step is DDP, they hold them whole and split their optimizer steps instead
(`experts_held_whole`). Under hybrid sharding each replica holds the same experts: at ep =
dp_shard their gradients are summed over the replicas at each synced backward
(`sum_over_replicas`); below it the experts' FSDP units are hybrid too, over (dp_replicate, edp).
Context and tensor parallelism are refused in one line (`check_layout`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..config.tree import ConfigError, ParallelismConfig
from ..distributed.mesh import ParallelDims

log = logging.getLogger("shardwise")

IMPLEMENTATION = "shardwise_ep"
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_SPLIT = "shardwise_expert_params"  # the root module's set of the split parameters' ids
_STATE = "shardwise_dispatch"  # each split experts module's `Dispatch`
_SYNC = "shardwise_experts_sync"  # the root module's [bool]: sum the experts' gradients over replicas
_REPLICAS = "shardwise_experts_replicas"  # the root's groups the experts' gradients are summed over


@dataclass(frozen=True)
class Dispatch:
    """What a split experts module's forward needs: its expert-parallel group, its number of
    experts (all ranks together), and the data-parallel size its gradients are divided by."""

    group: dist.ProcessGroup
    experts: int
    divisor: int
    edp: DeviceMesh | None = None
    """ep below the sharding group: the mesh of the ranks holding the same experts, over which
    the data-parallel step shards them (`expert_units`)"""
    load: list[torch.Tensor] = field(default_factory=list)
    """token slots this rank's training forwards routed to each expert since `take_load` (one
    tensor of `experts` counts, summed in place at each forward of the model, `_commit`)"""
    current: list[torch.Tensor] = field(default_factory=list)
    """the routing of the model's latest training forward (set, not added: a block recomputed
    in backward by activation checkpointing routes the same tokens again, counted once)"""


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's fused experts modules: transformers' (`use_experts_implementation` classes) and
    a user's own that declares the same layout (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
    `num_experts`, `act_fn`)."""
    found = []
    for name, m in model.named_modules():
        params = [getattr(m, p, None) for p in EXPERT_PARAMS]
        if all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params) and hasattr(m, "num_experts"):
            found.append((name, m))
    return found


def check_layout(dims: ParallelDims | ParallelismConfig, strategy: str, backend: str) -> None:
    """One-line refusals for what this version does not split experts under. It reads ep, cp and
    tp only, which the `parallelism` section gives as they run, so the layout asks it before the
    data-parallel sizes are resolved: a strategy that shards nothing is named as the reason, not
    the dp_shard its ranks then lack."""
    if dims.ep == 1:
        return
    where = f"expert_parallel_size={dims.ep}"
    if backend != "torch":
        raise ConfigError(f"{where}: the deepspeed backend's AutoEP is not driven by shardwise; "
                          "use backend: torch")
    if strategy not in ("zero1", "zero2", "zero3"):
        raise ConfigError(f"{where} needs strategy zero1, zero2 or zero3 (got {strategy}): the experts are "
                          "split over the sharding group")
    if dims.cp > 1 or dims.tp > 1:
        raise ConfigError(f"{where}: this version splits experts without context or tensor parallelism; "
                          "set those to 1")


def experts_to_split(model: nn.Module, ep: int, where: str, without: str) -> list[tuple[str, nn.Module]]:
    """The experts modules `ep` splits, or a one-line ConfigError starting with `where` (the key
    or flag that asked for it) and ending with `without` (how to do without): no experts module,
    GPT-OSS's layout, a count of experts `ep` does not divide. The step and the planner ask it."""
    layers = experts_modules(model)
    if not layers:
        raise ConfigError(f"{where}: {type(model).__name__} has no mixture-of-experts layer shardwise can "
                          "split (transformers' fused experts modules: gate_up_proj, down_proj, "
                          f"num_experts); {without}")
    for name, m in layers:
        if getattr(m, "is_transposed", False) or getattr(m, "has_bias", False) or \
                not getattr(m, "has_gate", True) or getattr(m, "has_post_expert_norm", False):
            raise ConfigError(f"{where}: {name} ({type(m).__name__}) stores its experts transposed or with "
                              "biases (GPT-OSS's layout), which this version does not split")
        count = int(getattr(m, "num_experts"))  # noqa: B009 (a plain int attribute, for mypy)
        if count % ep:
            raise ConfigError(f"{where} does not divide {name}'s {count} experts; choose a divisor of it")
    return layers


def expert_parallel_step(model: nn.Module, dims: ParallelDims) -> list[nn.Parameter]:
    """Split every experts module of `model` over the expert-parallel group, in place; returns the
    expert parameters (the data-parallel step leaves them out). Nothing at ep 1."""
    if dims.ep == 1:
        return []
    where = f"expert_parallel_size={dims.ep}"
    layers = experts_to_split(model, dims.ep, where, "use expert_parallel_size 1")
    mesh, edp = expert_mesh(dims)
    group = mesh.get_group()
    _register()
    params: list[nn.Parameter] = []
    for name, m in layers:
        for p in EXPERT_PARAMS:
            full = getattr(m, p)
            split = nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(0)]),
                                 requires_grad=full.requires_grad)
            setattr(m, p, split)
            params.append(split)
        # with an edp mesh the data-parallel step shards the experts over it (FSDP averages
        # their gradients over its dp_shard / ep ranks): the rest of the mean is divided here
        m.__dict__[_STATE] = Dispatch(group, int(getattr(m, "num_experts")),  # noqa: B009
                                      dims.ep if edp is not None else dims.dp_size, edp)
        if getattr(m, "config", None) is None:
            m.forward = _bound(m)  # a user's own layer: its forward is the dispatch
        elif not hasattr(model, "set_experts_implementation"):
            raise ConfigError(f"expert_parallel_size={dims.ep}: {name} is a transformers experts module "
                              f"inside {type(model).__name__}, not a transformers model: prepare the "
                              "transformers model itself")
    if any(getattr(m, "config", None) is not None for _, m in layers):
        model.set_experts_implementation(IMPLEMENTATION)  # type: ignore[operator]
    model.__dict__[_SPLIT] = {id(p) for p in params}  # read by `expert_params`
    if dims.dp_replicate > 1 and edp is None:  # the replicas' experts: gradients summed across them
        model.__dict__[_REPLICAS] = [dims.world_mesh["dp_replicate"].get_group()]
    model.register_forward_pre_hook(_commit_all)  # each forward's routing counted once (`Dispatch.current`)
    log.info("prepare: %d experts modules split over %d ranks (expert parallelism)", len(layers), dims.ep)
    return params


def sum_over_replicas(model: nn.Module) -> None:
    """Hybrid sharding: the data-parallel step leaves the experts alone, so their gradients (each
    the sum over its replica's tokens, divided by every data-parallel rank: `_Divided`) are
    all-reduced over the replicas here, once the gradient is whole: at each backward that syncs
    (`gradient_sync`: off during the micro-steps of an accumulation, whose sum the synced
    backward then all-reduces once). Called by the strategy once the model is laid out: hooks
    registered on the experts as this step splits them were seen never to fire (laying the model
    out replaces the DTensor parameters' tensors: torch swaps a subclass parameter's contents
    when it moves a module)."""
    groups = model.__dict__.get(_REPLICAS)
    if groups is None:
        return
    params = [p for p in model.parameters() if id(p) in model.__dict__[_SPLIT]]
    syncing = model.__dict__.setdefault(_SYNC, [True])

    def hook(p: torch.Tensor) -> None:
        if syncing[0] and p.grad is not None:
            for group in groups:  # (zero1 under hybrid sharding: the replicas, then the edp ranks)
                dist.all_reduce(_local(p.grad), group=group)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def experts_held_whole(model: nn.Module, dims: ParallelDims) -> dict[int, dist.ProcessGroup | None]:
    """zero1, whose data-parallel step (DDP) holds parameters whole and must leave the split
    experts out: the split expert parameters (by id), each with the other ranks holding the same
    experts within the sharding group (None: this rank alone), whose optimizer steps they share.
    Below the sharding group those (edp) ranks hold the experts whole, no FSDP unit over them:
    their gradients are summed over the edp ranks at each synced backward, as hybrid sharding's
    replicas' are (`sum_over_replicas`), each divided by every data-parallel rank."""
    held: dict[int, dist.ProcessGroup | None] = {}
    for m in model.modules():
        state = m.__dict__.get(_STATE)
        if state is None:
            continue
        edp = None
        if state.edp is not None:  # (under hybrid sharding 2-D: the replicas, then the edp ranks)
            groups = [state.edp.get_group(d) for d in range(state.edp.ndim)]
            edp = groups[-1]
            model.__dict__[_REPLICAS] = groups
            m.__dict__[_STATE] = dataclasses.replace(state, divisor=dims.dp_size, edp=None)
        held.update({id(getattr(m, p)): edp for p in EXPERT_PARAMS})
    return held


def gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether backward sums the experts' gradients over hybrid sharding's replicas (the
    strategy's `no_sync` turns it off with FSDP's own reduction)."""
    syncing = model.__dict__.get(_SYNC)
    if syncing is not None:
        syncing[0] = enabled


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The parameters this step split: the data-parallel step leaves them as they are."""
    ids = model.__dict__.get(_SPLIT, set())
    sharded = {id(p) for m, _ in expert_units(model) for p in m.parameters()}
    return {p for p in model.parameters() if id(p) in ids and id(p) not in sharded}


def _bound(m: nn.Module) -> Any:
    return lambda hidden, top_k_index, top_k_weights: dispatch_forward(m, hidden, top_k_index, top_k_weights)


# the (dp_replicate, edp, ep) meshes, one per process and layout (building one makes process
# groups collectively)
_MESHES: dict[tuple[str, int, int, int, int], DeviceMesh] = {}


def expert_mesh(dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the ep mesh the experts are split over, the edp mesh they are sharded over). At ep =
    dp_shard: the sharding mesh itself, and no edp (each rank holds 1/ep of the experts, whole).
    Below it: a mesh (dp_replicate, edp, ep) of the same ranks, ep consecutive ranks splitting
    the experts, and the dp_shard / ep ranks holding the same experts within a sharding group
    sharding them further, as torchtitan's efsdp does (so each rank holds 1/dp_shard of the
    experts either way); under hybrid sharding the edp mesh is (dp_replicate, edp), its first
    dimension the replicas."""
    if dims.ep == dims.dp_shard:
        return dims.world_mesh["dp_shard"], None
    key = (dims.device_type, dims.dp_replicate, dims.dp_shard, dims.ep, id(dist.group.WORLD))
    if key not in _MESHES:
        shape = (dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep)
        _MESHES[key] = init_device_mesh(dims.device_type, shape, mesh_dim_names=("dp_replicate", "edp", "ep"))
    mesh = _MESHES[key]
    return mesh["ep"], mesh["dp_replicate", "edp"] if dims.dp_replicate > 1 else mesh["edp"]


def expert_units(model: nn.Module) -> list[tuple[nn.Module, DeviceMesh]]:
    """The split experts modules the data-parallel step shards over their own edp mesh (ep below
    the sharding group), innermost first; empty at ep = dp_shard (their experts are ignored)."""
    return [(m, m.__dict__[_STATE].edp) for m in reversed(list(model.modules()))
            if _STATE in m.__dict__ and m.__dict__[_STATE].edp is not None]


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, dispatch_forward)


_SENT = [0]  # bytes this process's dispatches sent to other ranks (`sent_bytes`)


def sent_bytes(reset: bool = True) -> int:
    """Bytes this process's expert all-to-alls sent to other ranks (tokens out and results back,
    forward and backward; what stays on the rank is not counted) since the last reset."""
    out = _SENT[0]
    if reset:
        _SENT[0] = 0
    return out


def _count(x: torch.Tensor, send: list[int], group: dist.ProcessGroup) -> None:
    row = x[0].numel() * x.element_size() if len(x) else 0
    _SENT[0] += (sum(send) - send[dist.get_rank(group)]) * row


class _Exchange(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Any:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        _count(x, send, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        _count(grad, ctx.recv, ctx.group)
        return back, None, None, None


class _Divided(torch.autograd.Function):
    """The identity, whose backward divides the gradient: an expert's gradient arrives summed
    over its expert-parallel group's tokens, and the step wants the mean of every rank's loss
    (FSDP divides the other parameters' gradients, and the experts' over an edp mesh, by its
    own group's size; the rest is divided here)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad / ctx.n, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    return _Exchange.apply(x, send, recv, group)  # type: ignore[no-any-return,no-untyped-call]


def _divided(x: torch.Tensor, n: int) -> torch.Tensor:
    return _Divided.apply(x, n)  # type: ignore[no-any-return,no-untyped-call]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@dataclass(frozen=True)
class Routes:
    """Where one forward's token slots go (`routes`): this rank's slots by expert, what it sends
    to and receives from each rank, and the received rows' local experts."""

    order: torch.Tensor
    """the (T * k) token slots sorted by expert, hence by owning rank"""
    source_token: torch.Tensor
    """the token of each slot, in that order"""
    per_expert: torch.Tensor
    """this rank's slots per expert (all experts)"""
    send: list[int]
    """rows sent to each rank"""
    recv: list[int]
    """rows received from each rank"""
    expert_of: torch.Tensor
    """the local expert of each received row, in the order received (by source rank, each
    source's rows by expert)"""
    sizes: list[int]
    """received rows per local expert"""


def routes(top_k_index: torch.Tensor, experts: int, group: dist.ProcessGroup) -> Routes:
    """The routing of (T, k) chosen experts over the group: the per-expert counts are exchanged
    first (rank j receives the counts of its own experts), then the split sizes follow. The
    planner's trace replaces this with an even split (fake tensors hold no routing)."""
    n = dist.get_world_size(group)
    local = experts // n
    tokens, k = top_k_index.shape
    chosen = top_k_index.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    source_token = torch.arange(tokens, device=top_k_index.device).repeat_interleave(k)[order]
    per_expert = torch.bincount(chosen, minlength=experts)
    counts_in = torch.empty_like(per_expert)
    dist.all_to_all_single(counts_in, per_expert, group=group)
    counts_in = counts_in.view(n, local)  # [source rank, local expert]
    local_ids = torch.arange(local, device=top_k_index.device).repeat(n)
    expert_of = torch.repeat_interleave(local_ids, counts_in.reshape(-1))
    return Routes(order, source_token, per_expert, per_expert.view(n, local).sum(1).tolist(),
                  counts_in.sum(1).tolist(), expert_of, counts_in.sum(0).tolist())


def dispatch_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward under expert parallelism: (T, H) tokens, (T, k) chosen experts and
    their weights -> (T, H), equal to the unsplit layer's output."""
    state: Dispatch = self.__dict__[_STATE]
    group = state.group
    r = routes(top_k_index, state.experts, group)
    if torch.is_grad_enabled():  # training forwards only (an evaluation's routing is not the step's)
        state.current[:] = [r.per_expert]
    received = _exchange(hidden[r.source_token], r.send, r.recv, group)
    # the received tokens come by source rank, each source's by expert: regroup by local expert
    by_expert = torch.argsort(r.expert_of, stable=True)
    x = received[by_expert]
    sizes = r.sizes
    # (under an edp mesh: FSDP's unsharded parameter, this rank's experts whole)
    gate_up = _divided(_local(cast(torch.Tensor, self.gate_up_proj)), state.divisor)
    down = _divided(_local(cast(torch.Tensor, self.down_proj)), state.divisor)
    gate = getattr(self, "_apply_gate", None) or functools.partial(_gate, self)
    outs = []
    for e, chunk in enumerate(torch.split(x, sizes)):
        outs.append(nn.functional.linear(gate(nn.functional.linear(chunk, gate_up[e])), down[e]))
    y = torch.cat(outs) if outs else x
    y = y[torch.argsort(by_expert)]  # back to the order received
    returned = _exchange(y, r.recv, r.send, group)
    weights = top_k_weights.reshape(-1)[r.order].unsqueeze(-1)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, r.source_token, (returned * weights).to(hidden.dtype))


def _gate(self: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default gate (a user's layer without `_apply_gate`): act(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return getattr(self, "act_fn")(gate) * up  # type: ignore[no-any-return]  # noqa: B009


def _commit(state: Dispatch) -> None:
    """Add the latest forward's routing to the load (at the next forward of the model, and when
    the load is read)."""
    if state.current:
        if state.load:
            state.load[0] += state.current[0]
        else:
            state.load.append(state.current[0].clone())
        state.current.clear()


def _commit_all(model: nn.Module, args: Any) -> None:
    for m in model.modules():
        if _STATE in m.__dict__:
            _commit(m.__dict__[_STATE])


def take_load(models: list[nn.Module], steps: int, device: torch.device) -> list[list[float]] | None:
    """Token slots (k per token) routed to each expert per optimizer step since the last call,
    over every process's batch, one list per split experts module (in model order); None where
    no model's experts are split. Every process calls it (one all-reduce)."""
    states = [m.__dict__[_STATE] for model in models for m in model.modules() if _STATE in m.__dict__]
    if not states:
        return None
    for s in states:
        _commit(s)
    # (on the run's device: the all-reduce's backend takes its tensors there, NCCL included)
    table = torch.stack([s.load[0].to(device) if s.load else torch.zeros(s.experts, dtype=torch.long,
                                                                          device=device) for s in states])
    for s in states:
        s.load.clear()
    table = table.to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(table)
    return (table / max(1, steps)).tolist()


__all__ = ["IMPLEMENTATION", "check_layout", "dispatch_forward", "expert_parallel_step", "expert_params",
           "expert_units", "experts_modules", "experts_to_split", "gradient_sync", "sent_bytes",
           "sum_over_replicas", "take_load"]
