"""The typed configuration tree: the single source of truth for how a run is sharded and launched.

Every field carries a docstring right under it; the CLI turns them into its help. Values are
validated at construction, so a bad value is refused before any process group, model or
optimizer is touched. Files (YAML, DeepSpeed JSON, Accelerate YAML) and command-line flags only
fill this tree (see `config.files`); precedence is defaults < file < flags < `Engine(...)` keywords.
"""

from __future__ import annotations

import difflib
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

from .parallelism import (
    ConfigError as ConfigError,
    ParallelismConfig as ParallelismConfig,
    as_section,
    tensor_parallel,
)

# the strategy table lives in `specs`; re-exported here, where the config checks against it
from .specs import (
    AUTO as AUTO,
    BACKEND_TABLE as BACKEND_TABLE,
    OFFLOAD_TABLE as OFFLOAD_TABLE,
    STRATEGIES as STRATEGIES,
    STRATEGY_TABLE as STRATEGY_TABLE,
    BackendSpec as BackendSpec,
    OffloadSpec as OffloadSpec,
    StrategySpec as StrategySpec,
    backend_spec as backend_spec,
    check_log_with,
    is_auto as is_auto,
    offload_spec as offload_spec,
    plan_choices as plan_choices,
    strategy_spec as strategy_spec,
)

StrategyName = Literal["ddp", "zero1", "zero2", "zero3", "auto"]
PrecisionName = Literal["fp32", "bf16", "fp16"]
OffloadName = Literal["none", "optimizer", "params"]
BackendName = Literal["torch", "deepspeed"]
HostKernelName = Literal["torch", "deepspeed"]
ContextMethod = Literal["ring", "ulysses"]
ResumeName = Literal["auto", "required", "never"]
Rendezvous = Literal["c10d", "static"]
OptimizerType = Literal["AdamW", "Adam", "SGD"]
SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
Auto = Literal["auto"]
Node = Literal["node"]
CheckpointingName = Literal["none", "full", "selective", "offload"]

PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
OFFLOADS: tuple[str, ...] = get_args(OffloadName)
_S = TypeVar("_S")
MIN_COLLECTIVE_TIMEOUT_S = 5.0  # below it a healthy run's start-up or checkpoint collectives time out




def check_strategy(strategy: str, offload: str, backend: str) -> None:
    """Refuse a strategy, offload and backend that do not go together (the table's rules)."""
    if strategy == "auto":
        if backend != "torch":
            raise ConfigError(
                f"strategy='auto' plans for the torch backend; with backend={backend!r} name the "
                "strategy (zero1, zero2 or zero3), e.g. the one `shardwise plan` suggests"
            )
        return  # auto plans only among the plans with the offload given
    spec = STRATEGY_TABLE[strategy]
    if backend not in spec.backends:
        names = [n for n, s in STRATEGY_TABLE.items() if backend in s.backends]
        runs = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        raise ConfigError(
            f"strategy={strategy!r} is not run by backend={backend!r}; choose {runs} there, or "
            f"backend={spec.backends[0]!r} for {strategy}"
        )
    if offload not in spec.offloads:
        if offload == "params":
            raise ConfigError(
                f"offload='params' needs strategy='zero3' (got strategy={strategy!r}): only "
                "stage 3 shards parameters. Use offload='optimizer' with zero1/zero2, or zero3."
            )
        raise ConfigError(
            f"offload={offload!r} needs a sharded strategy (zero1, zero2 or zero3), got strategy={strategy!r}"
        )


def _choice(field_name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{field_name}={value!r} is not valid{hint}; choose one of: {', '.join(choices)}"
        )
    return value


def _positive(name: str, value: Any, *, allow_auto: bool = False, minimum: float = 1) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be a number >= {minimum}")


@dataclass(kw_only=True, slots=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored by fp32 and bf16)."""

    dynamic: bool = True
    """Adapt the scale to overflows; False keeps `init_scale` fixed (overflowing steps are still skipped)."""
    init_scale: float = 2.0**16
    """Loss scale of the first step."""
    growth_factor: float = 2.0
    """Factor the scale grows by after `growth_interval` steps without inf/nan gradients."""
    backoff_factor: float = 0.5
    """Factor the scale shrinks by when a step's gradients hold inf/nan (that step is skipped)."""
    growth_interval: int = 2000
    """Number of consecutive finite steps before the scale grows."""
    hysteresis: int = 1
    """Overflows tolerated (skipped without backing off) before the scale shrinks."""
    min_scale: float = 1.0
    """The scale never backs off below this value."""

    def __post_init__(self) -> None:
        _positive("loss_scale.init_scale", self.init_scale, minimum=1e-30)
        _positive("loss_scale.min_scale", self.min_scale, minimum=1e-30)
        if not (0 < self.backoff_factor < 1):
            raise ConfigError(
                f"loss_scale.backoff_factor={self.backoff_factor} must lie strictly between 0 and 1"
            )
        if self.growth_factor <= 1:
            raise ConfigError(f"loss_scale.growth_factor={self.growth_factor} must be > 1")
        _positive("loss_scale.growth_interval", self.growth_interval)
        _positive("loss_scale.hysteresis", self.hysteresis)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """An optimizer the Engine builds when the script passes none to `prepare`
    ("auto": the script's value, else the Hugging Face Trainer default)."""

    type: OptimizerType = "AdamW"
    """AdamW, Adam (with adam_w_mode it is AdamW) or SGD."""
    lr: float | Auto = "auto"
    """Learning rate ("auto": 5e-5)."""
    weight_decay: float | Auto = "auto"
    """Weight decay, not applied to biases and norms ("auto": 0.0)."""
    betas: tuple[float, float] | Auto = "auto"
    """Adam betas ("auto": (0.9, 0.999))."""
    eps: float | Auto = "auto"
    """Adam epsilon ("auto": 1e-8)."""
    momentum: float = 0.0
    """SGD momentum."""
    adam_w_mode: bool = True
    """For type Adam: decoupled weight decay (AdamW), as DeepSpeed's default."""


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """A DeepSpeed-style LR schedule the Engine builds when the script passes none."""

    type: SchedulerType = "WarmupDecayLR"
    """WarmupLR (warm up, then hold), WarmupDecayLR (then linear decay to 0), WarmupCosineLR."""
    warmup_min_lr: float | Auto = "auto"
    """LR at step 0 ("auto": 0)."""
    warmup_max_lr: float | Auto = "auto"
    """LR reached after warm-up ("auto": the optimizer's lr)."""
    warmup_num_steps: int | Auto = "auto"
    """Warm-up length in optimizer steps ("auto": 0)."""
    total_num_steps: int | Auto = "auto"
    """Steps until the LR reaches 0 ("auto": one pass over the prepared DataLoader)."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warm-up, as DeepSpeed's."""


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """How `shardwise launch` starts the workers (through torchrun)."""

    num_processes: int = 1
    """Worker processes per node (one per GPU; CPU processes on a machine without GPUs)."""
    num_nodes: int = 1
    """Machines taking part. More than one uses a c10d rendezvous at main_address:main_port."""
    node_rank: int = 0
    """This machine's index among the nodes (0 hosts the rendezvous)."""
    main_address: str = "127.0.0.1"
    """Address of node 0, reachable from every node."""
    main_port: int = 29500
    """Port of the rendezvous on node 0."""
    rdzv_backend: Rendezvous = "c10d"
    """Rendezvous backend for several nodes (one node uses torchrun's standalone rendezvous)."""
    rdzv_id: str = "shardwise"
    """Job id shared by every node of one run."""
    max_restarts: int = 0
    """How often torchrun restarts the workers after a failure."""

    def __post_init__(self) -> None:
        _positive("launch.num_processes", self.num_processes)
        _positive("launch.num_nodes", self.num_nodes)
        _positive("launch.main_port", self.main_port)
        if not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(
                f"launch.node_rank={self.node_rank} must lie in 0..{self.num_nodes - 1} "
                f"(launch.num_nodes={self.num_nodes})"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts={self.max_restarts} must be >= 0")


@dataclass(frozen=True, slots=True)
class ShardingSection:
    """The strategy's part of the tree (`EngineConfig.sharding`): what is sharded and how, the
    precision and its loss scale, the host step, and a DeepSpeed JSON's own keys."""

    strategy: StrategyName = "ddp"
    backend: BackendName = "torch"
    precision: PrecisionName = "fp32"
    offload: OffloadName = "none"
    shard_group_size: int | Node | None = None
    wrap: tuple[str | type, ...] = ()
    max_grad_norm: float | None = None
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    offload_bucket_numel: int = 2**24
    host_kernel: HostKernelName = "torch"
    deepspeed_config: str | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    context_parallel: ContextMethod = "ring"
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    parallelize: str | Callable[..., Any] | None = None


@dataclass(frozen=True, slots=True)
class BlocksSection:
    """What the session does to each block before sharding (`EngineConfig.blocks`): the block
    list, activation checkpointing and compilation."""

    wrap: tuple[str | type, ...] = ()
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int | None = None
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    compile_fullgraph: bool = False
    compile_dynamic: bool | None = None
    tiled_mlp: bool | None = None
    tiled_loss: bool | None = None
    tile_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class ObservationSection:
    """The observer's part of the tree (`EngineConfig.observation`): trackers, records, progress."""

    log_with: tuple[str, ...] = ()
    log_every_steps: int = 10
    progress: bool | None = None
    peak_tflops: float | None = None
    flops_per_token: float | None = None
    project_dir: str | None = None


@dataclass(frozen=True, slots=True)
class CheckpointSection:
    """The checkpoint manager's part of the tree (`EngineConfig.checkpointing`): where
    checkpoints go, how many stay, when the policy writes them, how, and where a run resumes."""

    dir: str = "checkpoints"
    every_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None
    background: bool = False
    resume: str = "auto"
    lock_lease_s: float = 300.0


@dataclass(frozen=True, slots=True)
class SupervisionSection:
    """The supervisor's part of the tree (`EngineConfig.supervision`): signals, grace, timeouts."""

    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    preempt_grace_s: float = 25.0
    collective_timeout_s: float = 600.0


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How an `Engine` shards, casts, accumulates and launches. The root of the config tree."""

    strategy: StrategyName = "ddp"
    """ddp: full replicas, gradients all-reduced. zero1: + optimizer states sharded.
    zero2: + gradients sharded. zero3: + parameters sharded (gathered per block for compute).
    auto: at prepare, plan for this device's memory, the world size and the DataLoader's batch
    and take the fastest strategy (and offload) that fits (`shardwise plan` explains the choice)."""
    backend: BackendName = "torch"
    """The library under the strategies: torch (FSDP2 / DDP) or deepspeed (DeepSpeed ZeRO stages
    1-3 and its offload; zero1/zero2/zero3 only; `pip install 'shardwise[deepspeed]'`)."""
    precision: PrecisionName = "fp32"
    """fp32; bf16 (bf16 compute, fp32 master weights, reduction and optimizer state);
    fp16 (as bf16, plus dynamic loss scaling)."""
    offload: OffloadName = "none"
    """none; optimizer: optimizer states and the optimizer step live on the host (zero1-3);
    params: parameter shards also live on the host between uses (zero3 only)."""
    shard_group_size: int | Node | None = None
    """Processes per sharding group (hybrid sharding): zero1-3 shard within each group of this
    many consecutive ranks and replicate across groups, all-reducing gradients across groups once
    per optimizer step. None: all processes (one group); "node": the processes of one node
    (LOCAL_WORLD_SIZE). Must divide the world size; with tensor_parallel_size T it holds whole tp
    groups (a multiple of T: G processes are G / T data-parallel ranks). ddp has nothing to shard
    and ignores it."""
    tensor_parallel_size: int = 1
    """Processes that split each layer of the model between them (tensor parallelism, innermost
    on the mesh: consecutive ranks, so within a node); they see the same batch, and the data is
    split over world / tensor_parallel_size data-parallel ranks. With ddp, zero2 or zero3 (torch
    backend): the layers are split first, then replicated or sharded over the data-parallel
    ranks. The model needs a plan (a transformers model's own, or tensor_parallel_plan)."""
    tensor_parallel_plan: dict[str, str] | None = None
    """Module path (`*` matches one name) -> how it is split: colwise, rowwise,
    colwise_gather_output, colwise_loss_parallel (the head's logits left split: compute the loss
    under `engine.loss_parallel()`), embedding_rowwise, replicate (None: the model's own plan)."""
    sequence_parallel: bool = False
    """With tensor_parallel_size > 1: the activations between the split layers (norms, residuals,
    dropouts) split over the sequence across the tp ranks too, instead of whole on each (the
    all-reduces become all-gathers and reduce-scatters of the same bytes). The sequence length
    must divide by tensor_parallel_size. Torch backend."""
    context_parallel_size: int = 1
    """Processes that split each sequence along its length (context parallelism, the mesh's cp
    dimension: parallelism.cp): they take the same samples, each holds 1/N of every sequence's
    tokens and activations, and attention spans the whole sequence (`context_parallel`). A
    transformers model (its attention is replaced through transformers' attention registry);
    ddp and zero1-3, hybrid sharding and tensor parallelism compose with it. Torch backend."""
    context_parallel: ContextMethod = "ring"
    """How attention spans a split sequence: ring (key/value blocks passed round the group, a
    zigzag split that balances the causal mask; any head count) or ulysses (two all-to-alls per
    attention: sequence shards to head shards and back; the heads must divide by the size)."""
    expert_parallel_size: int = 1
    """Processes that split each mixture-of-experts layer's experts (expert parallelism, the
    mesh's ep dimension: parallelism.ep): each holds 1/N of every layer's experts, and each token
    goes to the ranks that own its chosen experts and back (two all-to-alls, no token dropped).
    transformers' fused experts modules (Mixtral, Qwen2-MoE, ...) or a user's layer of the same
    layout. zero1, zero2 or zero3 (offload included, hybrid sharding too), N dividing the
    sharding group. Torch backend."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """The sizes of the run's named mesh dimensions: dp_replicate, dp_shard, cp, tp, ep (their
    product, ep aside, is the number of processes; -1: the rest). The keys above translate into
    it (tensor_parallel_size is tp, shard_group_size is dp_shard x tp processes); a size given both
    ways must agree. Each backend refuses, in one line, a dimension it does not split."""
    parallelize: str | Callable[..., Any] | None = None
    """Your own model-parallel step for a model with no plan: a function `parallelize(model,
    dims)` (or its "module:function" name) that splits `model` in place on the meshes of `dims`
    (`engine.parallel_dims`: `dims.get_mesh("tp")`, ...), as Lightning Fabric's
    ModelParallelStrategy takes one. It replaces the tensor-parallel plan step; activation
    checkpointing, compile and the data-parallel sharding follow as usual. Torch backend."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; gradients are communicated only on the last one."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this value at every optimizer step (None: only when
    the script calls clip_grad_norm_)."""
    seed: int | None = None
    """Seeds python, numpy and torch on every process, and the DataLoader shuffling. None: the
    engine seeds nothing (a script's own `set_seed` stands) and a shuffled DataLoader's order
    comes from its generator, or from one draw of the global torch generator, as Accelerate's."""
    cpu: bool = False
    """Run on CPU processes (gloo) even when GPUs are present."""
    wrap: tuple[str | type, ...] = ()
    """Module classes (or class names) sharded as units (zero2/zero3). Empty: detect the
    repeated blocks (a transformer's layers) automatically."""
    activation_checkpointing: CheckpointingName | bool = "none"
    """What each block keeps for backward. none; full (true): nothing inside the block, its forward
    is recomputed in backward; selective: the outputs of matrix multiplications (torch's selective
    policy), the rest recomputed, or with activation_checkpointing_every=k every k-th block full;
    offload: every saved activation, in host memory (pinned on CUDA), copied back for backward."""
    activation_checkpointing_every: int | None = None
    """selective only: recompute every this-many-th block in full (1st, k+1-th, ...) and keep the
    others' activations, instead of the matmul-output policy (None)."""
    compile: bool = False
    """Compile each block (the units found for sharding; the whole model when it has none) with
    torch.compile, fullgraph where it holds; a graph break, and a recompilation after the first step,
    is reported once per block class. Names, checkpoints and save_model stay eager's (no _orig_mod.)."""
    compile_backend: str = "inductor"
    """The torch.compile backend (inductor, aot_eager, eager, ...; torch.compiler.list_backends())."""
    compile_mode: str | None = None
    """torch.compile's mode: None (default), reduce-overhead, max-autotune, max-autotune-no-cudagraphs."""
    compile_fullgraph: bool = False
    """A graph break is an error naming the block and the reason (default: reported once, and the
    block runs compiled around the break)."""
    compile_dynamic: bool | None = None
    """torch.compile's dynamic: None (a shape seen to change is made dynamic, one recompile), True, False."""
    tiled_mlp: bool | None = None
    """Run each block's MLP (a transformers block's `mlp`) over tile_tokens tokens at a time and
    recompute it in backward, so its wide intermediate never exists for the whole sequence (as
    DeepSpeed's ALST tiles it). Exact (the MLP works token by token). None: on under context
    parallelism, off otherwise."""
    tiled_loss: bool | None = None
    """A transformers causal LM called with labels computes its head and cross entropy over
    tile_tokens tokens at a time, recomputed in backward: the logits (batch x sequence x
    vocabulary, fp32) never exist whole, and the output's `logits` is None. The same loss
    (summed per tile, divided by the tokens). None: on under context parallelism, off otherwise."""
    tile_tokens: int = 1024
    """Tokens per tile of tiled_mlp and tiled_loss (per sequence of the batch)."""
    micro_batch_size: int | Auto | None = None
    """Per-process batch the config expects (None/"auto": the prepared DataLoader's)."""
    train_batch_size: int | Auto | None = None
    """Global batch (micro x grad_accum_steps x processes) the config expects; checked at prepare."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build when the script passes none to prepare (from a DeepSpeed JSON, say)."""
    scheduler: SchedulerConfig | None = None
    """LR schedule to build with that optimizer."""
    checkpoint_dir: str = "checkpoints"
    """Where `save_state()` writes step_<N> folders and the `latest` pointer."""
    checkpoint_every_steps: int | None = None
    """Save a checkpoint (checkpoint_dir/step_<N>) every this many optimizer steps, at the step
    boundary, with no line in the script; `load_state()` at the start resumes from the newest."""
    checkpoint_every_seconds: float | None = None
    """Also save one when this many seconds have passed since the last (process 0's clock)."""
    keep_last: int | None = None
    """Keep only the newest this many step_<N> checkpoints (None: keep all)."""
    checkpoint_async: bool = False
    """save_state (and checkpoints by policy) copies the state to host memory, returns, and writes
    it in the background: atomic, checksummed and kept as a synchronous save; one save in flight
    (the next waits), and preemption, load_state and end_training wait for it."""
    collective_timeout_s: float = 600.0
    """A collective that does not complete within this many seconds ends the run with an error
    naming the step and the processes that did not arrive (torch's default is 30 minutes). At
    least 5: below that, ordinary start-up and checkpoint collectives fail inside gloo/NCCL."""
    lock_lease_s: float = 300.0
    """The run lock's lease (`<checkpoint_dir>/.shardwise.lock`): process 0 refreshes the lock's
    heartbeat every lease / 10 seconds while the run lives; a lock whose heartbeat is older than
    this is a dead run's, which a new run takes over with one line. A requeued attempt of the same
    SLURM job or torchrun run takes it over at once. On a shared file system the age is the file
    server's clock against itself. At least 1."""
    resume: ResumeName = "auto"
    """What `load_state()` (no folder given) does. auto: resume from the newest checkpoint under
    checkpoint_dir, or say in one line that there is none and start at step 0 (on a restart by
    `shardwise launch --max-restarts`, after an earlier attempt saved one, none is an error).
    required: no checkpoint is an error. never: load nothing (start at step 0) and say so."""
    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that make the run checkpoint at a step boundary (the second after the signal, the
    same on every process) and exit with code 75."""
    preempt_grace_s: float = 25.0
    """A process that reaches no step boundary within this many seconds of such a signal (or of
    its launcher's death, or of the last boundary since: the stop comes at the second boundary
    after the signal) exits without a checkpoint."""
    offload_bucket_numel: int = 2**24
    """Optimizer offload pipelines gradient copies, host steps and parameter copies in buckets
    of about this many elements (on deepspeed: its reduce and all-gather bucket sizes)."""
    host_kernel: HostKernelName = "torch"
    """The kernel of host optimizer steps (offload, or a CPU device): torch (torch's fused CPU
    kernel where the optimizer class has one: Adam, AdamW, SGD, Adagrad) or deepspeed
    (DeepSpeed's CPUAdam, for Adam/AdamW; needs deepspeed and, on first use, a C++ compiler).
    Either way the script's optimizer object, its state and checkpoints stay torch's. torch is
    the default: it measured at least as fast (benchmarks/host_optimizer.py)."""
    log_with: tuple[str, ...] = ()
    """Trackers for `log()` and the engine's own metrics: jsonl, tensorboard, wandb (main process)."""
    project_dir: str | None = None
    """Where trackers write (`<project_dir>/logs/<run>/`) and Accelerator's automatic checkpoints go."""
    log_every_steps: int = 10
    """Make a metrics record (loss, tokens/s, MFU, memory per process) every this many optimizer
    steps: one small all-gather each, no per-step sync (0: no records)."""
    progress: bool | None = None
    """A progress bar on the main process (None: when stderr is a terminal and not under CI)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU (None: a table of known GPUs; no MFU on CPU)."""
    flops_per_token: float | None = None
    """Model FLOPs per trained token (None: 6 x parameters, plus attention for transformers)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How `shardwise launch` starts the workers."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON file whose settings fill this tree (below any key this file sets)."""

    def _section(self, cls: type[_S], **renamed: Any) -> _S:
        """The section `cls` filled by name from the flat keys users write (which stay the
        source): each of its fields is this config's field of the same name, or `renamed`'s."""
        values = {f.name: renamed[f.name] if f.name in renamed else getattr(self, f.name)
                  for f in fields(cls)}  # type: ignore[arg-type]  # (a section dataclass)
        return cls(**values)

    @property
    def sharding(self) -> ShardingSection:
        """The strategy's settings as one section."""
        return self._section(ShardingSection)

    @property
    def blocks(self) -> BlocksSection:
        """Per-block transforms (activation checkpointing, compile) as one section."""
        return self._section(BlocksSection, activation_checkpointing=str(self.activation_checkpointing))

    @property
    def observation(self) -> ObservationSection:
        """Metrics, trackers and progress settings as one section."""
        return self._section(ObservationSection)

    @property
    def checkpointing(self) -> CheckpointSection:
        """The checkpoint settings as one section."""
        return self._section(CheckpointSection, dir=self.checkpoint_dir,
                             every_steps=self.checkpoint_every_steps,
                             every_seconds=self.checkpoint_every_seconds, background=self.checkpoint_async)

    @property
    def supervision(self) -> SupervisionSection:
        """Preemption and timeout settings as one section."""
        return self._section(SupervisionSection)

    def __post_init__(self) -> None:
        # each part of the tree checks its own fields (one function each, below)
        for check in (_check_sharding, _check_loop, _check_speed, _check_checkpointing, _check_observation,
                      _check_supervision, _check_sections):
            check(self)


def _int_at_least_1(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1 (or None)")


def _check_sharding(cfg: EngineConfig) -> None:
    """strategy, backend, precision, offload and how they combine; the hybrid group; the host step."""
    _choice("strategy", cfg.strategy, (*STRATEGIES, "auto"))
    _choice("backend", cfg.backend, get_args(BackendName))
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("offload", cfg.offload, OFFLOADS)
    check_strategy(cfg.strategy, cfg.offload, cfg.backend)
    _positive("offload_bucket_numel", cfg.offload_bucket_numel)
    group = cfg.shard_group_size
    if group is not None and group != "node" and (isinstance(group, bool) or not isinstance(group, int)
                                                  or group < 1):
        raise ConfigError(f"shard_group_size={group!r} must be an integer >= 1, 'node' (the processes "
                          "of one node) or None (all processes)")
    _choice("host_kernel", cfg.host_kernel, get_args(HostKernelName))
    _check_tensor_parallel(cfg)


TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_loss_parallel", "embedding_rowwise",
             "colwise_qkv", "replicate")


def _check_parallelism(cfg: EngineConfig) -> None:
    """The `parallelism` section: its sizes (checked by the section itself), the flat keys it
    must agree with, and the user's own model-parallel step."""
    cfg.parallelism = as_section(cfg.parallelism)
    section = cfg.parallelism
    if STRATEGY_TABLE.get(cfg.strategy) is not None and STRATEGY_TABLE[cfg.strategy].stage == 0 \
            and section.dp_shard not in (None, 1, -1):
        raise ConfigError(f"parallelism.dp_shard={section.dp_shard} with strategy: ddp, which shards nothing "
                          "(its data-parallel ranks are dp_replicate); choose zero1, zero2 or zero3")
    fn = cfg.parallelize
    if fn is not None and not callable(fn) and not (isinstance(fn, str) and ":" in fn):
        raise ConfigError(f"parallelize={fn!r} must be a function parallelize(model, dims) or its "
                          "'module:function' name")
    if fn is not None and cfg.backend == "deepspeed":
        raise ConfigError("parallelize with backend: deepspeed: DeepSpeed splits layers by its own AutoTP; "
                          "use backend: torch for your own model-parallel step")


def _agree_size(cfg: EngineConfig, key: str, dim: str) -> int:
    """A flat size key (context_parallel_size, expert_parallel_size) and its `parallelism`
    dimension: an integer >= 1 that agrees with the section's; both read the same from here on."""
    size, section = getattr(cfg, key), cfg.parallelism
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{key}={size!r} must be an integer >= 1")
    given = getattr(section, dim)
    if size > 1 and given not in (1, size):
        raise ConfigError(f"parallelism.{dim}={given} and {key}={size} disagree; set one of them")
    agreed = max(size, given)
    setattr(section, dim, agreed)
    setattr(cfg, key, agreed)
    return int(agreed)


def _check_context_parallel(cfg: EngineConfig) -> None:
    """context_parallel_size (parallelism.cp, which it must agree with) and its method."""
    cp = _agree_size(cfg, "context_parallel_size", "cp")
    if cfg.context_parallel not in ("ring", "ulysses"):
        raise ConfigError(f"context_parallel={cfg.context_parallel!r} must be ring or ulysses")
    if cp > 1 and cfg.strategy == "auto":
        raise ConfigError(f"strategy: auto with context_parallel_size={cp}: the planner does not "
                          "model context parallelism yet; name the strategy (zero3 shards over data x "
                          "context ranks)")


def _check_expert_parallel(cfg: EngineConfig) -> None:
    """expert_parallel_size (parallelism.ep, which it must agree with)."""
    _agree_size(cfg, "expert_parallel_size", "ep")


def _check_tensor_parallel(cfg: EngineConfig) -> None:
    """tensor_parallel_size: an integer >= 1; above 1, the torch backend (every strategy and offload)."""
    tp = cfg.tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
    _check_parallelism(cfg)
    # the section's tp and the flat key agree (or one was refused): both read the same from here on
    tp = cfg.tensor_parallel_size = tensor_parallel(cfg.parallelism, tp)
    _check_context_parallel(cfg)
    _check_expert_parallel(cfg)
    plan = cfg.tensor_parallel_plan
    valid = isinstance(plan, dict) and all(isinstance(k, str) and v in TP_STYLES for k, v in plan.items())
    if plan is not None and not valid:
        raise ConfigError(f"tensor_parallel_plan={plan!r} must map module paths to one of "
                          f"{', '.join(TP_STYLES)}")
    if not isinstance(cfg.sequence_parallel, bool):
        raise ConfigError(f"sequence_parallel={cfg.sequence_parallel!r} must be true or false")
    if cfg.sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel: true splits the activations over the tensor-parallel ranks: "
                          "set tensor_parallel_size above 1 with it, or leave sequence_parallel off")
    if cfg.sequence_parallel and cfg.backend == "deepspeed":
        raise ConfigError("sequence_parallel: true with backend: deepspeed: DeepSpeed's AutoTP has no "
                          "sequence parallelism; use backend: torch")
    if tp == 1:
        return
    if cfg.backend == "deepspeed" and STRATEGY_TABLE[cfg.strategy].shards_params:
        raise ConfigError(f"tensor_parallel_size={tp} with backend: deepspeed and strategy: {cfg.strategy}: "
                          "DeepSpeed trains AutoTP only up to ZeRO-2; use zero2, or backend: torch (every "
                          "ZeRO stage composes with tensor parallelism there)")


def _check_loop(cfg: EngineConfig) -> None:
    """Accumulation, seed, clipping and batch sizes."""
    accum = cfg.grad_accum_steps
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ConfigError(f"grad_accum_steps={cfg.grad_accum_steps!r} must be an integer >= 1")
    if cfg.seed is not None and (isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int)):
        raise ConfigError(f"seed={cfg.seed!r} must be an integer (or None: the engine seeds nothing)")
    if cfg.max_grad_norm is not None:
        _positive("max_grad_norm", cfg.max_grad_norm, minimum=1e-12)
    for name in ("micro_batch_size", "train_batch_size"):
        value = getattr(cfg, name)
        if value is not None:
            _positive(name, value, allow_auto=True)


def _check_checkpointing(cfg: EngineConfig) -> None:
    """When checkpoints are written and how many are kept; where a run resumes from."""
    for name in ("checkpoint_every_steps", "keep_last"):
        if getattr(cfg, name) is not None:
            _int_at_least_1(name, getattr(cfg, name))
    if cfg.checkpoint_every_seconds is not None:
        _positive("checkpoint_every_seconds", cfg.checkpoint_every_seconds, minimum=1e-3)
    _positive("lock_lease_s", cfg.lock_lease_s, minimum=1.0)
    _choice("resume", cfg.resume, get_args(ResumeName))


def _check_observation(cfg: EngineConfig) -> None:
    """Trackers, the metrics' cadence and what MFU is computed from."""
    try:
        cfg.log_with = check_log_with(cfg.log_with)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    every = cfg.log_every_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(f"log_every_steps={every!r} must be an integer >= 0 (0: no records)")
    for name in ("peak_tflops", "flops_per_token"):
        if getattr(cfg, name) is not None:
            _positive(name, getattr(cfg, name), minimum=1e-12)


def _check_supervision(cfg: EngineConfig) -> None:
    """Collective timeouts, preemption signals and their grace period."""
    _positive("collective_timeout_s", cfg.collective_timeout_s, minimum=1e-3)
    if cfg.collective_timeout_s < MIN_COLLECTIVE_TIMEOUT_S:
        raise ConfigError(
            f"collective_timeout_s={cfg.collective_timeout_s!r} is too short: a healthy run's "
            f"collectives can take that long; use at least {MIN_COLLECTIVE_TIMEOUT_S:g} (seconds)"
        )
    _positive("preempt_grace_s", cfg.preempt_grace_s, minimum=0)
    if isinstance(cfg.preempt_signals, str):
        cfg.preempt_signals = (cfg.preempt_signals,)
    cfg.preempt_signals = tuple(cfg.preempt_signals)
    for name in cfg.preempt_signals:
        is_signal = isinstance(name, str) and name.startswith("SIG") and hasattr(signal, name)
        if not is_signal or name in ("SIGKILL", "SIGSTOP"):  # those two cannot be caught
            raise ConfigError(
                f"preempt_signals: {name!r} is not a signal a process can catch; e.g. SIGTERM, SIGUSR1"
            )


def _check_sections(cfg: EngineConfig) -> None:
    """The block list, the nested sections given as mappings, and what needs what."""
    if isinstance(cfg.wrap, (str, type)):
        cfg.wrap = (cfg.wrap,)
    cfg.wrap = tuple(cfg.wrap)
    for item in cfg.wrap:
        if not isinstance(item, (str, type)):
            raise ConfigError(f"wrap entries must be module classes or class names, got {item!r}")
    for name, cls in (("loss_scale", LossScaleConfig), ("launch", LaunchConfig)):
        if isinstance(getattr(cfg, name), dict):
            setattr(cfg, name, cls(**getattr(cfg, name)))
    if cfg.scheduler is not None and cfg.optimizer is None:
        raise ConfigError("scheduler needs an optimizer section to build with it")


def _check_speed(cfg: EngineConfig) -> None:
    """activation_checkpointing (a bool means full or none) and the compile settings."""
    ac = cfg.activation_checkpointing
    if isinstance(ac, bool):
        cfg.activation_checkpointing = "full" if ac else "none"
    _choice("activation_checkpointing", cfg.activation_checkpointing, get_args(CheckpointingName))
    every = cfg.activation_checkpointing_every
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"activation_checkpointing_every={every!r} must be an integer >= 1 (or None)")
        if cfg.activation_checkpointing != "selective":
            raise ConfigError(
                f"activation_checkpointing_every={every} applies to activation_checkpointing: selective "
                f"only (it is {cfg.activation_checkpointing!r}); set it to selective or drop the setting")
    for name in ("compile", "compile_fullgraph", "checkpoint_async"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} must be true or false")
    if cfg.compile_dynamic is not None and not isinstance(cfg.compile_dynamic, bool):
        raise ConfigError(f"compile_dynamic={cfg.compile_dynamic!r} must be true, false or None")
    for name in ("tiled_mlp", "tiled_loss"):
        if getattr(cfg, name) is not None and not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} must be true, false or None (on under context "
                              "parallelism)")
    tile = cfg.tile_tokens
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ConfigError(f"tile_tokens={tile!r} must be an integer >= 1")
    modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    if cfg.compile_mode is not None:
        _choice("compile_mode", cfg.compile_mode, modes)
    if not isinstance(cfg.compile_backend, str) or not cfg.compile_backend:
        raise ConfigError(f"compile_backend={cfg.compile_backend!r} must name a torch.compile backend "
                          "(e.g. inductor)")
    if cfg.compile:
        _check_compile(cfg)


def _check_compile(cfg: EngineConfig) -> None:
    """compile: true: a backend that compiles blocks, a torch.compile backend torch has here, a
    mode only inductor takes."""
    if not backend_spec(cfg.backend).compiles_blocks:
        raise ConfigError(f"compile: true is not supported with backend: {cfg.backend} (its engine wraps the "
                          "model itself); use backend: torch to compile each block, or compile: false")
    import torch

    known = torch.compiler.list_backends(exclude_tags=())
    if cfg.compile_backend not in known:
        raise ConfigError(f"compile_backend={cfg.compile_backend!r} is not a torch.compile backend of this "
                          f"torch ({torch.__version__}); choose one of: "
                          f"{', '.join(sorted({*torch.compiler.list_backends(), 'aot_eager', 'eager'}))}")
    if cfg.compile_mode not in (None, "default") and cfg.compile_backend != "inductor":
        raise ConfigError(f"compile_mode={cfg.compile_mode!r} is an inductor setting; drop compile_mode or "
                          f"use compile_backend: inductor (it is {cfg.compile_backend!r})")
