"""Run real training steps of a model on fake tensors and record what every rank would hold.

Nothing is allocated and no device is needed: the model's parameters are `FakeTensor`s (shapes
and dtypes only), the process group is torch's "fake" backend of the planned world size, and the
model goes through our own `Engine.prepare` with the strategy under study, so DDP's buckets,
zero1's flat sharded optimizer, FSDP2's shards and all-gather buffers and both offload modes are
the real code paths. We then run the usual loop (forward, loss, backward, optimizer step,
zero_grad) and count live tensor storage the way an allocator would (`counter.py`). A hybrid
candidate (`shard_group_size`) runs the same way on its 2-D (replicate, shard) mesh of fake
ranks, which the strategy builds as in a real run (FSDP2 slices it per parameter: `fakes.py`).

The per-rank figure is rank 0's (FSDP2 pads shards evenly; zero1's first ranks own the full
chunks). Fake tensors hold no data, so a data-dependent `nonzero` is taken at its largest (every
element nonzero: what label masks give). CPU processes need no emulation of gloo: FSDP2's
reduce-scatter runs there as an in-place all-reduce (`strategies/fsdp.py`), no transient copy.
Two steps are traced, at two batch sizes, each read as a steady-state step (`counter.step_views`).

**Segments.** The count is kept per segment of the step, so that a trace of a model cut to a few
layers can be extrapolated to its full depth (see `fit.py`): forward and backward are split at
the repeated blocks into `pre` (below the first block: embeddings), the blocks counted from each
end (`b0`, `b1` and `bL2`, `bL1`: second-to-last and last), and `post` (head and loss); the
optimizer step and zero_grad are segments of their own. Inside the stack every block behaves the
same except for how many layers of activations and gradients lie below or above it, so a
segment's peak is linear in the depth, and the interior blocks never exceed the peak of `b1` or
`bL2`.

**Roles.** After the run each storage gets one role, in this order of precedence: parameters
(model parameters and buffers, sharded or gathered), gradients (the `.grad` the optimizer reads),
optimizer (whatever the optimizer runner keeps: Adam moments, host masters and gradient buffers
of the offload runner), communication (the arguments of collectives: DDP buckets, FSDP2 all-gather
and reduce-scatter buffers, zero1's gather buffers), activations (anything else made in forward,
including the inputs and the previous step's outputs) and temporaries (anything else made in
backward or the optimizer step).

**Device and host.** This runs on CPU, where everything is host memory; a CUDA run keeps some of
it on the host, and the planner needs to know which part. By the offload's spec
(`config.OFFLOAD_TABLE`): optimizer on the host (`offload="optimizer"`, with zero1, zero2 or
zero3) keeps the optimizer role (states and fp32 masters of the rank's slice) and the
temporaries of the optimizer step there, while parameters and gradients stay on the device
(zero1: the full replicas and full gradients; zero3: the parameter shards); parameters on the
host (`offload="params"`, FSDP2's CPUOffloadPolicy) also keep the parameter shards and gradient
shards there, while gathered parameters, activations and buffers are on the device. Not seen by
the trace on CPU: the device copies of parameter shards that FSDP2 makes before each all-gather
under parameter offload (one unit's shard at a time), and the workspaces of CUDA libraries.
Activation checkpointing runs as it runs for real (full and selective recompute in backward,
so the trace sees what they keep and what they recompute, FLOPs included); for a CUDA target,
`activation_checkpointing: offload` is traced with the host copies a GPU makes of every saved
activation (`_copy_offloaded`): host memory, not device memory. On a CPU target the saved
activations already are host memory and nothing is copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..checkpoint.sharded import kept_rng
from ..config.tree import EngineConfig, OffloadSpec
from ..distributed.internals import is_sharded, local_tensor
from ..distributed.world import init_distributed
from ..engine.session import Session
from ..strategies import make_strategy
from ..strategies.expert_parallel import EXPERT_PARAMS, experts_modules
from .candidate import Candidate
from .counter import ROLES, SegmentPeak, StepMarks, StorageCounter, replay, resize_seen, step_views
from .fakes import (
    even_routing,
    fake_ddp,
    fake_mode,
    fake_world,
    no_ddp_shape_check,
    patched,
    real_mesh_slices,
    storage_key,
    tree_leaves,
    unpacked_sequences,
)

__all__ = ["ROLES", "Candidate", "SegmentPeak", "TraceJob", "TraceResult", "default_loss", "run_trace"]
# fp16 is traced as bf16: the same bytes, without a loss scaler (its few scalars are not worth a
# path of their own). A lookup, not a rule: config has no precision table to ask yet.
_TRACED_AS = {"fp16": "bf16"}


@dataclass(frozen=True, slots=True)
class TraceResult:
    """What one traced configuration held on rank 0 during the second training step."""

    total: dict[str, SegmentPeak]  # host + device, the figure a CPU run holds
    device: dict[str, SegmentPeak]  # what a CUDA run keeps on the device
    host: dict[str, float]  # what a CUDA run keeps on the host, peak per segment
    comm_bytes: dict[str, float]  # bytes through each kind of collective in one step
    flops: float  # forward + backward (+ recompute) FLOPs of one step on rank 0
    offload_bytes: float  # host<->device copies one step needs under offload (per rank)
    host_optimizer_numel: float  # elements the host optimizer steps (offload), per rank
    parameters: float  # parameters of the traced (possibly cut) model
    staging: float = 0.0  # bytes a checkpoint copies to host memory (checkpoint_async), per rank
    tp_parameters: float = 0.0  # parameters each tensor-parallel rank holds (tp-split ones cut by tp)
    expert_parameters: float = 0.0  # of `parameters`, the experts' (mixture-of-experts layers)



# -- hooks that mark segments -------------------------------------------------------------------
def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in `obj` that needs a gradient (a hook on it fires in backward)."""
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _positions(j: int, depth: int) -> tuple[str, ...]:
    """The segment names of block `j` of `depth`: counted from the bottom and from the top."""
    keys = []
    if j == 0:
        keys.append("b0")
    if j == 1:
        keys.append("b1")
    if j == depth - 2:
        keys.append("bL2")
    if j == depth - 1:
        keys.append("bL1")
    return tuple(keys)


def _hook_blocks(blocks: list[nn.Module], counter: StorageCounter, model: nn.Module) -> list[Any]:
    """Hooks that mark the segments at each block's forward and (through its output's gradient
    hook) backward, and claim the parameters each block's unit gathers; the hooks' handles."""
    depth = len(blocks)
    handles = []
    for j, block in enumerate(blocks):
        pos = _positions(j, depth)

        def pre(
            mod: nn.Module, args: Any, kwargs: Any, _j: int = j, _pos: tuple[str, ...] = pos
        ) -> None:
            if counter.phase != "fwd" or not torch.is_grad_enabled():
                return
            counter.mark(*(f"fwd.{p}" for p in _pos))
            if _j == 0:
                counter.claim("params", model.parameters())  # the root unit's gathered parameters
                x = _first_grad_tensor((args, kwargs))
                if x is not None:
                    x.register_hook(lambda g: counter.mark("bwd.pre"))
            counter.claim("params", mod.parameters())  # gathered by FSDP2's pre-forward hook

        def post(
            mod: nn.Module, args: Any, kwargs: Any, out: Any, _j: int = j, _pos: tuple[str, ...] = pos
        ) -> None:
            if counter.phase != "fwd" or not torch.is_grad_enabled():
                return
            if _j == depth - 1:
                counter.mark("fwd.post")
            y = _first_grad_tensor(out)
            if y is not None:
                y.register_hook(lambda g: counter.mark(*(f"bwd.{p}" for p in _pos)))

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    return handles



# -- one traced configuration -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceJob:
    """Everything one trace needs; `build` makes the (fake) model inside the fake mode."""

    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]  # per-device batch size -> a batch as the loader yields it
    loss_fn: Callable[[Any, Any], torch.Tensor]  # (model output, batch) -> loss
    candidate: Candidate
    world_size: int
    batches: tuple[int, int]  # the two per-device batch sizes measured (b1 < b2)
    precision: str = "fp32"
    foreach: bool | None = None  # the optimizer's foreach (what CUDA defaults to: True)
    grad_accum_steps: int = 1
    wrap: tuple[Any, ...] = ()
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    count_flops: bool = False
    staging: bool = False
    """measure the state a checkpoint copies to the host (`checkpoint_async`); skipped otherwise
    (building the state dicts is a tenth of a trace's time)"""
    local_world_size: int | None = None
    """processes per node (None: `world_size`, one node); tensor parallelism stays within one"""
    target: str = "cpu"
    """the device planned for: on "cuda", activations offloaded by `activation_checkpointing:
    offload` are copied to the host as a CUDA run copies them (on CPU they stay where they are)"""
    tile_tokens: int | None = None
    """tiled MLP and loss over this many tokens (context parallelism's default), None: off"""


@dataclass(frozen=True, slots=True)
class _Prepared:
    """The model and optimizer as `Engine.prepare` left them on the fake ranks."""

    model: nn.Module
    optimizer: Any  # our prepared optimizer (its `runner` holds the optimizer's tensors)
    blocks: list[nn.Module]  # the repeated blocks, whose hooks mark the segments
    sharded: list[torch.Tensor]  # the prepared parameters (DTensor shards under FSDP2)
    sharded_ids: set[int]  # the counter's serials of their storages
    parameters: int  # parameters of the model as built (before sharding)
    tp_parameters: float  # of those, what one tensor-parallel rank holds (all of them without TP)
    expert_parameters: float  # of those, the experts' (`expert_parallel.experts_modules`)


@dataclass(frozen=True, slots=True)
class _Stepped:
    """What the training steps left besides the counter's log."""

    marks: dict[str, int]  # log positions: start0, batch0, fwd0, start1, end
    comm: list[dict[str, float]]  # per step: bytes per kind of collective
    flops: list[float]  # per step: one micro-step's FLOPs (when counted)


def run_trace(job: TraceJob) -> dict[int, TraceResult]:
    """Prepare the model with the candidate's strategy on fake ranks and trace two steps, one
    at each batch size of `job.batches` (see `counter.step_views`); the result per batch size."""
    counter = StorageCounter()
    with contextlib.ExitStack() as stack:
        session = _enter_fake_world(job, counter, stack)
        prepared = _prepare(job, session, counter, stack)
        handles = _hook_blocks(prepared.blocks, counter, prepared.model)
        stepped = _train(job, session, prepared, counter)
        for h in handles:
            h.remove()
        # (after the log's last mark: not in the peaks)
        staging = _checkpoint_bytes(session, prepared) if job.staging else 0.0
    return _results(job, counter, prepared, stepped, staging)


def _checkpoint_bytes(session: Session, prep: _Prepared) -> float:
    """Bytes of the state a checkpoint of this rank holds: the local tensors of the state dict
    `checkpoint.save` builds (the strategy's model state and the runner's checkpoint state, which
    for zero1 is gathered whole), each storage once; what `checkpoint_async` copies to the host."""
    state = [session.strategy.model_state(prep.model), prep.optimizer.runner.checkpoint_state(prep.model)]
    seen: set[int] = set()
    total = 0
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor):
            local = local_tensor(t)
            key = storage_key(local.untyped_storage())
            if key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
    return float(total)


def _enter_fake_world(job: TraceJob, counter: StorageCounter, stack: contextlib.ExitStack) -> Session:
    """Step 1: the `Session` that `Engine.prepare` builds, on a fake world of `job.world_size`
    ranks (made outside the fake mode), then the fake mode and the patches the trace runs under."""

    cand = job.candidate
    cfg = EngineConfig.of(strategy=cand.strategy, offload=cand.offload, cpu=True,
                      precision=_TRACED_AS.get(job.precision, job.precision),
                      activation_checkpointing=cand.activation_checkpointing,
                      activation_checkpointing_every=cand.activation_checkpointing_every,
                      wrap=tuple(job.wrap),
                      grad_accum_steps=job.grad_accum_steps,
                      shard_group_size=None if cand.shard_group_size is None  # the config counts processes
                      else cand.shard_group_size * cand.tensor_parallel_size,
                      tensor_parallel_size=cand.tensor_parallel_size,
                      sequence_parallel=cand.sequence_parallel,
                      expert_parallel_size=cand.expert_parallel_size,
                      **({} if job.tile_tokens is None else
                         {"tiled_mlp": True, "tiled_loss": True, "tile_tokens": job.tile_tokens}))
    stack.enter_context(kept_rng())  # Engine() seeds every generator; a plan inside a script must not
    stack.enter_context(fake_world(job.world_size))
    info = init_distributed(force_cpu=True)
    if cand.tensor_parallel_size > 1:  # the tp ranks lie within a node: the node's processes
        info = dataclasses.replace(info, local_world_size=job.local_world_size or job.world_size)
    session = Session(cfg.blocks, make_strategy(cfg, info), grad_accum_steps=cfg.training.grad_accum_steps,
                      max_grad_norm=cfg.training.max_grad_norm)
    stack.enter_context(fake_mode())
    stack.enter_context(patched(torch.UntypedStorage, "resize_", resize_seen(counter)))
    stack.enter_context(no_ddp_shape_check())
    stack.enter_context(real_mesh_slices())
    stack.enter_context(unpacked_sequences())
    stack.enter_context(even_routing())
    if job.target == "cuda" and cand.activation_checkpointing == "offload":
        _copy_offloaded(counter, stack)
    return session


def _copy_offloaded(counter: StorageCounter, stack: contextlib.ExitStack) -> None:
    """Offloaded activations as a CUDA run keeps them: each saved tensor (the block's parameters
    aside) gets a host copy, counted as host memory until backward releases it, and comes back
    as a new device tensor when backward unpacks it; the device original dies with its last
    other reference, as it does on a GPU."""
    from ..strategies import blocks

    def to_device(packed: Any, pin: bool) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed  # what `to_host` kept where it was (host tensors)
        return cast(torch.Tensor, packed[1].clone())

    def to_host(t: torch.Tensor, pin: bool) -> Any:
        host = t.clone()
        counter.host_copies.add(counter.see(host))
        return (t.device, host)

    stack.enter_context(patched(blocks, "to_host", to_host))
    stack.enter_context(patched(blocks, "to_device", to_device))


def _prepare(job: TraceJob, session: Session, counter: StorageCounter,
             stack: contextlib.ExitStack) -> _Prepared:
    """Step 2: build the fake model, start counting, and prepare model and optimizer with the
    candidate's strategy; every parameter, buffer and optimizer tensor gets its role."""
    from ..strategies import find_blocks

    model = job.build()
    n_experts = sum(getattr(m, p).numel() for _, m in experts_modules(model) for p in EXPERT_PARAMS)
    # The fake parameters are already where they belong; moving them would try to swap them.
    model.to = lambda *a, **k: model  # type: ignore[method-assign]
    blocks = find_blocks(model, job.wrap)
    make_opt = job.optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=job.foreach))
    stack.enter_context(counter)
    counter.claim("params", list(model.parameters()) + list(model.buffers()))
    n_full = sum(p.numel() for p in model.parameters())
    optimizer = make_opt(model.parameters())
    prepared = session.prepare([model], [optimizer], [])
    model, optimizer = prepared[id(model)], prepared[id(optimizer)]
    fake_ddp(model, counter.on_bucket)
    sharded = list(model.parameters())
    counter.claim("params", sharded + list(model.buffers()))
    sharded_ids = {counter.see(p) for p in sharded}
    counter.claim("optimizer", optimizer.runner.tensors())
    return _Prepared(model, optimizer, blocks, sharded, sharded_ids, n_full, _tp_share(sharded), n_experts)


def _tp_share(params: list[torch.Tensor]) -> float:
    """Parameters one tensor-parallel rank holds before data-parallel sharding: a weight split
    over the mesh's "tp" dimension counts 1/tp of its elements, any other whole."""
    total = 0.0
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        cut = 1
        if "tp" in names:
            dim = names.index("tp")
            if not p.placements[dim].is_replicate():  # type: ignore[attr-defined]  # Shard, _StridedShard
                cut = cast(Any, mesh).size(dim)
        total += p.numel() / cut
    return total


def _train(job: TraceJob, session: Session, prep: _Prepared, counter: StorageCounter) -> _Stepped:
    """Step 3: one optimizer step (of `grad_accum_steps` micro-steps) at each batch size,
    marking the segments and the positions `counter.step_views` reads."""
    marks: dict[str, int] = {}
    comm: list[dict[str, float]] = []
    flops: list[float] = []
    live = _Loop()
    for step, batch_size in enumerate(job.batches):
        marks[f"start{step}"] = len(counter.log)
        counter.comm_bytes, counter.counting = {}, True  # this step's collectives
        for _micro in range(job.grad_accum_steps):
            _micro_step(job, session, prep, counter, live, batch_size)
            marks.setdefault(f"batch{step}", live.batch_at)
            marks.setdefault(f"fwd{step}", live.fwd_at)
        comm.append(dict(counter.comm_bytes))
        flops.append(counter.flops)
    marks["end"] = len(counter.log)
    return _Stepped(marks, comm, flops)


class _Loop:
    """The training loop's variables: the batch and the outputs stay alive until the next
    micro-step rebinds them (as in `for batch in loader: out = model(batch)`)."""

    batch: Any = None
    out: Any = None
    batch_at = 0  # log position once this micro-step's batch exists
    fwd_at = 0  # log position once its forward returned


def _micro_step(job: TraceJob, session: Session, prep: _Prepared, counter: StorageCounter, live: _Loop,
                batch_size: int) -> None:
    """Batch, forward, loss, backward, optimizer step and zero_grad, each in its own phase."""
    model, optimizer = prep.model, prep.optimizer
    counter.phase = "batch"
    live.batch = job.make_batch(batch_size)  # the previous batch dies here
    counter.claim("activations", [t for t in tree_leaves(live.batch) if isinstance(t, torch.Tensor)])
    live.batch_at = len(counter.log)
    counter.phase = "fwd"
    counter.mark("fwd.pre")
    counter.flops, counter.count_flops = 0.0, job.count_flops  # one micro-step's FLOPs
    with session.accumulate([model], loader_at_end=False):
        live.out = _forward(model, live.batch)  # the previous outputs live until this returns
        live.fwd_at = len(counter.log)
        loss = job.loss_fn(live.out, live.batch)
        counter.phase = "bwd"
        counter.mark("bwd.post")
        session.backward(loss)
    counter.count_flops = False
    counter.claim("grads", [p.grad for p in model.parameters()])
    counter.phase = "opt"
    counter.mark("opt")
    optimizer.step()
    counter.claim("optimizer", optimizer.runner.tensors())
    counter.claim("grads", [p.grad for p in model.parameters()])
    counter.phase = "zero"
    counter.mark("zero")
    optimizer.zero_grad()
    counter.mark()
    del loss


class _Placement:
    """Step 4: each storage's role, and whether a CUDA run keeps it on the host (module doc)."""

    def __init__(self, counter: StorageCounter, off: OffloadSpec, sharded_ids: set[int]) -> None:
        self.counter, self.off, self.sharded_ids = counter, off, sharded_ids
        # host-side roles: the optimizer's state and fp32 masters under optimizer offload; with
        # parameter offload also the parameter shards and the gradient shards (FSDP2's policy)
        self.host_roles = {"optimizer"} if off.optimizer_on_host else set()
        if off.params_on_host:
            self.host_roles |= {"grads", "params"}

    @staticmethod
    def source(serial: int) -> int:
        """The storage behind a serial (negative serials: `step_views`' virtual previous step)."""
        return -serial - 1 if serial < 0 else serial

    def role_of(self, serial: int) -> str:
        """The claimed role, else activations (made in forward or the batch) or temporaries."""
        s = self.source(serial)
        r = self.counter.role.get(s)
        if r is not None:
            return r
        return "activations" if self.counter.born.get(s) in ("fwd", "batch") else "temporaries"

    def host_of(self, serial: int) -> bool:
        """A CUDA run keeps this storage in host memory."""
        s = self.source(serial)
        if s in self.counter.host_copies:
            return True  # an activation offloaded by activation checkpointing
        if not self.off.any:
            return False
        role = self.counter.role.get(s)
        if role is None and self.counter.born.get(s) == "opt":
            return True  # the host optimizer step's temporaries
        if role == "params":
            return "params" in self.host_roles and s in self.sharded_ids
        return role in self.host_roles


def _host_step_share(p: torch.Tensor, world_size: int) -> float:
    """Elements of `p` this rank's optimizer steps: its local shard where the parameter is
    sharded (FSDP2), its 1/W slice of a replica where it is not (zero1)."""
    return float(local_tensor(p).numel()) if is_sharded(p) else p.numel() / world_size


def _offload_traffic(cand: Candidate, prep: _Prepared, world_size: int) -> tuple[float, float]:
    """Step 5: (host<->device bytes per step, elements stepped on the host), per rank.

    Under optimizer offload the rank's gradient slice goes to the host and its updated slice
    comes back (2 copies); under parameter offload the shards also go up for every all-gather
    (forward, and backward under zero3) and the gradients come down (3 copies)."""
    off = cand.offload_spec
    if not off.optimizer_on_host:
        return 0.0, 0.0
    shares = [(_host_step_share(p, world_size), local_tensor(p).element_size()) for p in prep.sharded]
    copies = 3.0 if off.params_on_host else 2.0
    return copies * sum(n * size for n, size in shares), sum(n for n, _ in shares)


def _results(job: TraceJob, counter: StorageCounter, prep: _Prepared, st: _Stepped,
             staging: float) -> dict[int, TraceResult]:
    """Step 6: replay each step's view of the log into peaks per segment, one result per batch."""
    cand = job.candidate
    place = _Placement(counter, cand.offload_spec, prep.sharded_ids)
    m = st.marks
    marks = StepMarks(m["start0"], m["batch0"], m["fwd0"], m["start1"], m["end"])
    b1, b2 = job.batches
    offload_bytes, host_numel = _offload_traffic(cand, prep, job.world_size)
    results = {}
    for i, (view, window) in enumerate(step_views(counter, marks, b2 / b1)):
        total, device, host = replay(view, window, place.role_of, place.host_of)
        results[job.batches[i]] = TraceResult(
            total=total, device=device, host=host, comm_bytes=st.comm[i], flops=st.flops[i],
            offload_bytes=offload_bytes, host_optimizer_numel=host_numel, parameters=float(prep.parameters),
            staging=staging, tp_parameters=prep.tp_parameters,
            expert_parameters=float(prep.expert_parameters),
        )
    return results


def _forward(model: nn.Module, batch: Any) -> Any:
    """The model called on a batch as the loader yields it (keywords, positions or one tensor)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def default_loss(out: Any, batch: Any) -> torch.Tensor:
    """The model's own loss (`transformers` models given labels), else the mean of its output."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is not None:
        return cast(torch.Tensor, loss)
    t = out if isinstance(out, torch.Tensor) else _first_grad_tensor(out)
    if t is None:
        raise TypeError(
            f"cannot find a loss in the model's output ({type(out).__name__}); pass loss_fn"
        )
    return t.float().mean()
