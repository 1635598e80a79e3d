"""The typed configuration tree: the single source of truth for how a run is sharded and launched.

The root (`EngineConfig`) holds one section per part that owns its settings (`sharding`,
`parallelism`, `blocks`, `training`, `checkpointing`, `supervision`, `observation`, `launch`, and
the optimizer and scheduler to build); the sections hold the values. A flat key (`strategy`,
`grad_accum_steps`: `FLAT_KEYS`) is another spelling of one section's field, moved there by `nest`.

Every field carries a docstring right under it; the CLI turns them into its help. Values are
validated at construction, so a bad value is refused before any process group, model or
optimizer is touched. Files (YAML, DeepSpeed JSON, Accelerate YAML) and command-line flags only
fill this tree (see `config.files`); precedence is defaults < file < flags < `Engine(...)` keywords.
"""

from __future__ import annotations

import difflib
import re
import signal
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from .parallelism import (
    TP_STYLES as TP_STYLES,
    ConfigError as ConfigError,
    ParallelismConfig as ParallelismConfig,
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
    check_strategy as check_strategy,
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
ResumeName = Literal["auto", "required", "never"]
Rendezvous = Literal["c10d", "static"]
OptimizerType = Literal["AdamW", "Adam", "SGD"]
SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
Auto = Literal["auto"]
Node = Literal["node"]
CheckpointingName = Literal["none", "full", "selective", "offload"]

PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
OFFLOADS: tuple[str, ...] = get_args(OffloadName)
MIN_COLLECTIVE_TIMEOUT_S = 5.0  # below it a healthy run's start-up or checkpoint collectives time out




def _choice(field_name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = suggest(value, list(choices), cutoff=0.6) if isinstance(value, str) else ""
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


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """What is sharded and how (`sharding:`): the strategy, its backend, the precision and its loss
    scale, what is offloaded to the host and how the host steps, the hybrid sharding group, and a
    DeepSpeed JSON whose settings fill the tree."""

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
    (LOCAL_WORLD_SIZE). Must divide the world size; with context_parallel_size C and
    tensor_parallel_size T it holds whole groups of C x T processes (a multiple of C x T: G
    processes are G / (C x T) data-parallel ranks). ddp has nothing to shard and ignores it."""
    offload_bucket_numel: int = 2**24
    """Optimizer offload pipelines gradient copies, host steps and parameter copies in buckets
    of about this many elements (on deepspeed: its reduce and all-gather bucket sizes)."""
    host_kernel: HostKernelName = "torch"
    """The kernel of host optimizer steps (offload, or a CPU device): torch (torch's fused CPU
    kernel where the optimizer class has one: Adam, AdamW, SGD, Adagrad) or deepspeed
    (DeepSpeed's CPUAdam, for Adam/AdamW; needs deepspeed and, on first use, a C++ compiler).
    Either way the script's optimizer object, its state and checkpoints stay torch's. torch is
    the default: it measured at least as fast (benchmarks/host_optimizer.py)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON file whose settings fill this tree (below any key this file sets)."""

    def __post_init__(self) -> None:
        _check_sharding(self)


@dataclass(kw_only=True, slots=True)
class BlocksConfig:
    """What is done to each block before sharding (`blocks:`): the block list, activation
    checkpointing, compilation and tiling."""

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

    def __post_init__(self) -> None:
        _check_blocks(self)


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The training loop's settings (`training:`): accumulation, clipping, seeding, the device, and
    the batch sizes the config expects."""

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
    micro_batch_size: int | Auto | None = None
    """Per-process batch the config expects (None/"auto": the prepared DataLoader's)."""
    train_batch_size: int | Auto | None = None
    """Global batch (micro x grad_accum_steps x processes) the config expects; checked at prepare."""

    def __post_init__(self) -> None:
        _check_training(self)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where checkpoints go, when the policy writes them, how many stay, how they are written, and
    where a run resumes (`checkpointing:`; the checkpoint manager's settings)."""

    dir: str = "checkpoints"
    """Where `save_state()` writes step_<N> folders and the `latest` pointer."""
    every_steps: int | None = None
    """Save a checkpoint (checkpoint_dir/step_<N>) every this many optimizer steps, at the step
    boundary, with no line in the script; `load_state()` at the start resumes from the newest."""
    every_seconds: float | None = None
    """Also save one when this many seconds have passed since the last (process 0's clock)."""
    keep_last: int | None = None
    """Keep only the newest this many step_<N> checkpoints (None: keep all)."""
    background: bool = False
    """save_state (and checkpoints by policy) copies the state to host memory, returns, and writes
    it in the background: atomic, checksummed and kept as a synchronous save; one save in flight
    (the next waits), and preemption, load_state and end_training wait for it."""
    resume: ResumeName = "auto"
    """What `load_state()` (no folder given) does. auto: resume from the newest checkpoint under
    checkpoint_dir, or say in one line that there is none and start at step 0 (on a restart by
    `shardwise launch --max-restarts`, after an earlier attempt saved one, none is an error).
    required: no checkpoint is an error. never: load nothing (start at step 0) and say so."""
    lock_lease_s: float = 300.0
    """The run lock's lease (`<checkpoint_dir>/.shardwise.lock`): process 0 refreshes the lock's
    heartbeat every lease / 10 seconds while the run lives; a lock whose heartbeat is older than
    this is a dead run's, which a new run takes over with one line. A requeued attempt of the same
    SLURM job or torchrun run takes it over at once. On a shared file system the age is the file
    server's clock against itself. At least 1."""

    def __post_init__(self) -> None:
        _check_checkpointing(self)


@dataclass(kw_only=True, slots=True)
class SupervisionConfig:
    """Preemption signals, their grace period and the collective timeout (`supervision:`; the
    supervisor's settings)."""

    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that make the run checkpoint at a step boundary (the second after the signal, the
    same on every process) and exit with code 75."""
    preempt_grace_s: float = 25.0
    """A process that reaches no step boundary within this many seconds of such a signal (or of
    its launcher's death, or of the last boundary since: the stop comes at the second boundary
    after the signal) exits without a checkpoint."""
    collective_timeout_s: float = 600.0
    """A collective that does not complete within this many seconds ends the run with an error
    naming the step and the processes that did not arrive (torch's default is 30 minutes). At
    least 5: below that, ordinary start-up and checkpoint collectives fail inside gloo/NCCL."""
    hang_watch: bool | None = None
    """A thread that ends a process whose collectives hang with the same line as a timeout: no
    progress (forward, backward, step) for collective_timeout_s while the GPU's queued work does
    not finish (NCCL's collectives are asynchronous: the process blocks in a device sync, where no
    timeout reaches it). None: on where the device is a GPU; true: on CPU too; false: off (NCCL's
    own watchdog, set 60 s later, aborts the process)."""

    def __post_init__(self) -> None:
        _check_supervision(self)


@dataclass(kw_only=True, slots=True)
class ObservationConfig:
    """Trackers, metrics records and progress (`observation:`; the observer's settings)."""

    log_with: tuple[str, ...] = ()
    """Trackers for `log()` and the engine's own metrics: jsonl, tensorboard, wandb (main process)."""
    log_every_steps: int = 10
    """Make a metrics record (loss, tokens/s, MFU, memory per process) every this many optimizer
    steps: one small all-gather each, no per-step sync (0: no records)."""
    progress: bool | None = None
    """A progress bar on the main process (None: when stderr is a terminal and not under CI)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU (None: a table of known GPUs; no MFU on CPU)."""
    flops_per_token: float | None = None
    """Model FLOPs per trained token (None: 6 x parameters, plus attention for transformers)."""
    project_dir: str | None = None
    """Where trackers write (`<project_dir>/logs/<run>/`) and Accelerator's automatic checkpoints go."""

    def __post_init__(self) -> None:
        _check_observation(self)


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How an `Engine` shards, casts, accumulates, checkpoints and launches: the root of the config
    tree, one section per part that owns its settings. A file or `Engine(...)` may also name each
    setting by its flat key (`strategy: zero3`, `grad_accum_steps: 4`: see "Flat keys" below), which
    is only another spelling of the section's field (`EngineConfig.of`, `config.tree.nest`)."""

    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """What is sharded and how: strategy, backend, precision, offload, the hybrid group."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """The named mesh dimensions' sizes and how each splits the model."""
    blocks: BlocksConfig = field(default_factory=BlocksConfig)
    """What is done to each block: activation checkpointing, compile, tiling."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Accumulation, clipping, seed, device and the expected batch sizes."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build when the script passes none to prepare (from a DeepSpeed JSON, say)."""
    scheduler: SchedulerConfig | None = None
    """LR schedule to build with that optimizer."""
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and when checkpoints are written, how many stay, where a run resumes."""
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    """Preemption signals, their grace and the collective timeout."""
    observation: ObservationConfig = field(default_factory=ObservationConfig)
    """Trackers, metrics records and progress."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How `shardwise launch` starts the workers."""

    @staticmethod
    def section_type(name: str) -> type:
        """The dataclass of the section `name` (`sharding` -> ShardingConfig)."""
        return _SECTION_TYPES[name]

    @classmethod
    def of(cls, **keys: Any) -> EngineConfig:
        """A config from keywords in either spelling: sections (`sharding={"strategy": "zero3"}`)
        or flat keys (`strategy="zero3"`); an unknown keyword is refused with the closest name."""
        nested = nest(keys, "", what="setting")  # (its refusals name what they were given)
        try:
            return cls(**nested)
        except ConfigError as err:
            raise ConfigError(as_written(str(err), flat_spellings(keys))) from None

    def with_keys(self, **keys: Any) -> EngineConfig:
        """A copy with the settings `keys` (flat keys, as `of` takes them) changed, checked again."""
        changes: dict[str, dict[str, Any]] = {}
        for key, value in keys.items():
            if key not in FLAT_KEYS:
                raise ConfigError(f"with_keys: unknown setting {key!r}{suggest(key, list(FLAT_KEYS))}")
            section, name = FLAT_KEYS[key]
            changes.setdefault(section, {})[name] = value
        return replace(self, **{s: replace(getattr(self, s), **c) for s, c in changes.items()})

    if not TYPE_CHECKING:  # (hidden from the type checker: shardwise's own code reads the sections)

        def __getattr__(self, name: str) -> Any:
            """A flat key read off the tree (`config.strategy`): its section's field, for scripts
            written against the flat spelling. Read-only: a config is changed by `with_keys`."""
            if name in FLAT_KEYS:
                section, key = FLAT_KEYS[name]
                return getattr(getattr(self, section), key)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __post_init__(self) -> None:
        for name, cls in _SECTION_TYPES.items():  # sections given as mappings (a file's, a keyword's)
            value = getattr(self, name)
            if isinstance(value, Mapping):
                valid = [f.name for f in fields(cls)]
                for key in value:
                    if key not in valid:
                        raise ConfigError(unknown_key(str(key), valid, f"{name}."))
                setattr(self, name, cls(**value))
            elif value is not None and not isinstance(value, cls):
                raise ConfigError(f"{name}={value!r} must be a mapping of its settings ({cls.__name__})")
        # what one section asks of another (each section checked its own fields when it was made)
        _check_layout(self)
        if self.blocks.compile:
            _check_compile(self)
        if self.scheduler is not None and self.optimizer is None:
            raise ConfigError("scheduler needs an optimizer section to build with it")


_SECTION_TYPES: dict[str, type] = {
    "sharding": ShardingConfig, "parallelism": ParallelismConfig, "blocks": BlocksConfig,
    "training": TrainingConfig, "optimizer": OptimizerConfig, "scheduler": SchedulerConfig,
    "checkpointing": CheckpointConfig, "supervision": SupervisionConfig, "observation": ObservationConfig,
    "launch": LaunchConfig,
}

# The flat keys: each is another spelling of one section's field (the keys shardwise took before its
# tree had sections, and the names of the command line's flags). The section's field is the source.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "strategy": ("sharding", "strategy"),
    "backend": ("sharding", "backend"),
    "precision": ("sharding", "precision"),
    "offload": ("sharding", "offload"),
    "shard_group_size": ("sharding", "shard_group_size"),
    "offload_bucket_numel": ("sharding", "offload_bucket_numel"),
    "host_kernel": ("sharding", "host_kernel"),
    "loss_scale": ("sharding", "loss_scale"),
    "deepspeed_config": ("sharding", "deepspeed_config"),
    "wrap": ("blocks", "wrap"),
    "activation_checkpointing": ("blocks", "activation_checkpointing"),
    "activation_checkpointing_every": ("blocks", "activation_checkpointing_every"),
    "compile": ("blocks", "compile"),
    "compile_backend": ("blocks", "compile_backend"),
    "compile_mode": ("blocks", "compile_mode"),
    "compile_fullgraph": ("blocks", "compile_fullgraph"),
    "compile_dynamic": ("blocks", "compile_dynamic"),
    "tiled_mlp": ("blocks", "tiled_mlp"),
    "tiled_loss": ("blocks", "tiled_loss"),
    "tile_tokens": ("blocks", "tile_tokens"),
    "grad_accum_steps": ("training", "grad_accum_steps"),
    "max_grad_norm": ("training", "max_grad_norm"),
    "seed": ("training", "seed"),
    "cpu": ("training", "cpu"),
    "micro_batch_size": ("training", "micro_batch_size"),
    "train_batch_size": ("training", "train_batch_size"),
    "checkpoint_dir": ("checkpointing", "dir"),
    "checkpoint_every_steps": ("checkpointing", "every_steps"),
    "checkpoint_every_seconds": ("checkpointing", "every_seconds"),
    "keep_last": ("checkpointing", "keep_last"),
    "checkpoint_async": ("checkpointing", "background"),
    "resume": ("checkpointing", "resume"),
    "lock_lease_s": ("checkpointing", "lock_lease_s"),
    "preempt_signals": ("supervision", "preempt_signals"),
    "preempt_grace_s": ("supervision", "preempt_grace_s"),
    "collective_timeout_s": ("supervision", "collective_timeout_s"),
    "hang_watch": ("supervision", "hang_watch"),
    "log_with": ("observation", "log_with"),
    "log_every_steps": ("observation", "log_every_steps"),
    "progress": ("observation", "progress"),
    "peak_tflops": ("observation", "peak_tflops"),
    "flops_per_token": ("observation", "flops_per_token"),
    "project_dir": ("observation", "project_dir"),
    "tensor_parallel_size": ("parallelism", "tp"),
    "context_parallel_size": ("parallelism", "cp"),
    "expert_parallel_size": ("parallelism", "ep"),
    "tensor_parallel_plan": ("parallelism", "tp_plan"),
    "sequence_parallel": ("parallelism", "sequence_parallel"),
    "context_parallel": ("parallelism", "cp_method"),
    "parallelize": ("parallelism", "parallelize"),
}


def suggest(key: str, valid: list[str], cutoff: float = 0.5) -> str:
    """' (did you mean ...?)' naming the closest valid key (`difflib`'s `cutoff`), or nothing."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key(key: str, valid: list[str], prefix: str = "") -> str:
    """The refusal of `key` (inside the section `prefix`, "launch." say): the closest valid key, and
    all of them."""
    return (f"unknown key '{prefix}{key}'{suggest(key, valid)}; "
            f"valid keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(valid)}")


def _as_mapping(value: Any) -> dict[str, Any]:
    """A section given as a mapping or as its dataclass, as a dict of its fields."""
    if isinstance(value, Mapping):
        return dict(value)
    return {f.name: getattr(value, f.name) for f in fields(value)}


def nest(data: Mapping[str, Any], source: str = "config", *, what: str = "key") -> dict[str, Any]:
    """Settings in either spelling as the tree's sections: each flat key moves to its section's
    field. A setting written both ways must agree, a default included (`_agreed`); a field its
    section only implies (not written: its default) yields to the flat key. Unknown keys are
    refused with the closest valid one."""
    out: dict[str, Any] = {}
    flat: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in _SECTION_TYPES:
            if key == "parallelism" and isinstance(value, Mapping) and value.get("tp", 1) is None:
                # (a file written before the sections: null was "tensor_parallel_size's")
                value = {k: v for k, v in value.items() if k != "tp"}
            out[key] = value
        elif key in FLAT_KEYS:
            flat.append((key, value))
        else:
            valid = [*_SECTION_TYPES, *FLAT_KEYS]
            raise ConfigError(f"{source + ': ' if source else ''}unknown {what} '{key}'"
                              f"{suggest(str(key), valid)}; valid {what}s: {', '.join(valid)}")
    written = {name: _written(value, _SECTION_TYPES[name]) for name, value in out.items()}
    for key, value in flat:
        section_name, name = FLAT_KEYS[key]
        if section_name == "parallelism" and name in ("tp", "cp", "ep"):  # (named as the user spelled it)
            try:
                _int_at_least_1(key, value, what="")
            except ConfigError as err:
                raise ConfigError(f"{source + ': ' if source else ''}{err}") from None
        given = out.get(section_name)
        section = {} if given is None else _as_mapping(given)
        try:
            section[name] = _agreed(f"{section_name}.{name}", written.get(section_name, {}), key, value)
        except ConfigError as err:
            raise ConfigError(f"{source + ': ' if source else ''}{err}") from None
        out[section_name] = section
    return out


def _written(given: Any, cls: type) -> dict[str, Any]:
    """The fields a section wrote: every key of a mapping (a file's, a keyword's); of a section
    object (`ShardingConfig(...)`), the fields away from their defaults, since one left at its
    default cannot be told from one never written."""
    if isinstance(given, Mapping):
        return dict(given)
    if given is None or not isinstance(given, cls):
        return {}  # (not a section: the tree refuses it when it is made)
    return {f.name: getattr(given, f.name) for f in fields(cls)
            if not _same(getattr(given, f.name), _default_of(cls, f.name))}


def _agreed(path: str, written: Mapping[str, Any], key: str, value: Any) -> Any:
    """The value of the field `path` (`parallelism.tp`) that its flat key `key` gives as `value`:
    where the section wrote the field too (`written`), both must say the same, a default included
    (`parallelism: {cp: 1}` beside `context_parallel_size: 2` is refused, not run at either)."""
    name = path.split(".", 1)[1]
    if name in written and not _same(written[name], value):
        raise ConfigError(f"{path}={written[name]!r} and {key}={value!r} disagree; set one of them")
    return value


def _same(a: Any, b: Any) -> bool:
    """Two spellings of one value (a YAML list and a keyword's tuple alike)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return bool(a == b)


def flat_spellings(data: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """The settings `data` gives by their flat keys: (section, field) -> the key."""
    return {FLAT_KEYS[key]: key for key in data if key in FLAT_KEYS}


def as_written(message: str, spelled: Mapping[tuple[str, str], str]) -> str:
    """A refusal that begins with the setting it refuses, by its flat key (a check's
    `checkpoint_every_steps=0 must be ...`) or by its section's path (a type error's
    `training.cpu: expected ...`), with that setting named as it was written: by the flat key
    when `spelled` (`flat_spellings`) holds it, else by its section's path."""
    head = re.match(r"([a-z_]+)(?:\.([a-z_]+))?(?=[=:])", message)
    if head is None:
        return message
    if head[2] is None and head[1] in FLAT_KEYS:
        section, name = FLAT_KEYS[head[1]]
    elif head[1] in _SECTION_TYPES and head[2] is not None:
        section, name = head[1], head[2]
    else:
        return message
    return spelled.get((section, name), f"{section}.{name}") + message[len(head[0]):]


def _default_of(cls: type, name: str) -> Any:
    for f in fields(cls):
        if f.name == name:
            return f.default if f.default_factory is MISSING else f.default_factory()
    raise KeyError(name)


def _int_at_least_1(name: str, value: Any, what: str = " (or None)") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1{what}")


def _check_sharding(s: ShardingConfig) -> None:
    """strategy, backend, precision, offload and how they combine; the hybrid group; the host step."""
    _choice("strategy", s.strategy, (*STRATEGIES, "auto"))
    _choice("backend", s.backend, get_args(BackendName))
    _choice("precision", s.precision, PRECISIONS)
    _choice("offload", s.offload, OFFLOADS)
    check_strategy(s.strategy, s.offload, s.backend)
    _positive("offload_bucket_numel", s.offload_bucket_numel)
    group = s.shard_group_size
    if group is not None and group != "node" and (isinstance(group, bool) or not isinstance(group, int)
                                                  or group < 1):
        raise ConfigError(f"shard_group_size={group!r} must be an integer >= 1, 'node' (the processes "
                          "of one node) or None (all processes)")
    _choice("host_kernel", s.host_kernel, get_args(HostKernelName))
    if isinstance(s.loss_scale, Mapping):
        s.loss_scale = LossScaleConfig(**s.loss_scale)


def _check_layout(cfg: EngineConfig) -> None:
    """The `parallelism` section against the strategy and backend: a dimension the backend does
    not split, or the strategy does not shard, is refused in one line."""
    section, sharding = cfg.parallelism, cfg.sharding
    spec = STRATEGY_TABLE.get(sharding.strategy)
    if spec is not None and spec.stage == 0 and section.dp_shard not in (None, 1, -1):
        raise ConfigError(f"parallelism.dp_shard={section.dp_shard} with strategy: ddp, which shards nothing "
                          "(its data-parallel ranks are dp_replicate); choose zero1, zero2 or zero3")
    deepspeed = sharding.backend == "deepspeed"
    if section.parallelize is not None and deepspeed:
        raise ConfigError("parallelize with backend: deepspeed: DeepSpeed splits layers by its own AutoTP; "
                          "use backend: torch for your own model-parallel step")
    if section.cp > 1 and sharding.strategy == "auto":
        raise ConfigError(f"strategy: auto with context_parallel_size={section.cp}: the planner does not "
                          "model context parallelism yet; name the strategy (zero3 shards over data x "
                          "context ranks)")
    if section.sequence_parallel and deepspeed:
        raise ConfigError("sequence_parallel: true with backend: deepspeed: DeepSpeed's AutoTP has no "
                          "sequence parallelism; use backend: torch")
    if section.tp > 1 and deepspeed and STRATEGY_TABLE[sharding.strategy].shards_params:
        raise ConfigError(f"tensor_parallel_size={section.tp} with backend: deepspeed and strategy: "
                          f"{sharding.strategy}: DeepSpeed trains AutoTP only up to ZeRO-2; use zero2, or "
                          "backend: torch (every ZeRO stage composes with tensor parallelism there)")


def _check_training(t: TrainingConfig) -> None:
    """Accumulation, seed, clipping and batch sizes."""
    accum = t.grad_accum_steps
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ConfigError(f"grad_accum_steps={t.grad_accum_steps!r} must be an integer >= 1")
    if not isinstance(t.cpu, bool):
        raise ConfigError(f"cpu={t.cpu!r} must be true or false")
    if t.seed is not None and (isinstance(t.seed, bool) or not isinstance(t.seed, int)):
        raise ConfigError(f"seed={t.seed!r} must be an integer (or None: the engine seeds nothing)")
    if t.max_grad_norm is not None:
        _positive("max_grad_norm", t.max_grad_norm, minimum=1e-12)
    for name in ("micro_batch_size", "train_batch_size"):
        value = getattr(t, name)
        if value is not None:
            _positive(name, value, allow_auto=True)


def _check_checkpointing(c: CheckpointConfig) -> None:
    """When checkpoints are written and how many are kept; where a run resumes from."""
    for key, value in (("checkpoint_every_steps", c.every_steps), ("keep_last", c.keep_last)):
        if value is not None:
            _int_at_least_1(key, value)
    if c.every_seconds is not None:
        _positive("checkpoint_every_seconds", c.every_seconds, minimum=1e-3)
    _positive("lock_lease_s", c.lock_lease_s, minimum=1.0)
    _choice("resume", c.resume, get_args(ResumeName))
    if not isinstance(c.background, bool):
        raise ConfigError(f"checkpoint_async={c.background!r} must be true or false")


def _check_observation(o: ObservationConfig) -> None:
    """Trackers, the metrics' cadence and what MFU is computed from."""
    try:
        o.log_with = check_log_with(o.log_with)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if o.progress is not None and not isinstance(o.progress, bool):
        raise ConfigError(f"progress={o.progress!r} must be true, false or None (a bar when the output is a "
                          "terminal)")
    every = o.log_every_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(f"log_every_steps={every!r} must be an integer >= 0 (0: no records)")
    for name in ("peak_tflops", "flops_per_token"):
        if getattr(o, name) is not None:
            _positive(name, getattr(o, name), minimum=1e-12)


def _check_supervision(s: SupervisionConfig) -> None:
    """Collective timeouts, preemption signals and their grace period."""
    _positive("collective_timeout_s", s.collective_timeout_s, minimum=1e-3)
    if s.collective_timeout_s < MIN_COLLECTIVE_TIMEOUT_S:
        raise ConfigError(
            f"collective_timeout_s={s.collective_timeout_s!r} is too short: a healthy run's "
            f"collectives can take that long; use at least {MIN_COLLECTIVE_TIMEOUT_S:g} (seconds)"
        )
    _positive("preempt_grace_s", s.preempt_grace_s, minimum=0)
    if isinstance(s.preempt_signals, str):
        s.preempt_signals = (s.preempt_signals,)
    s.preempt_signals = tuple(s.preempt_signals)
    for name in s.preempt_signals:
        is_signal = isinstance(name, str) and name.startswith("SIG") and hasattr(signal, name)
        if not is_signal or name in ("SIGKILL", "SIGSTOP"):  # those two cannot be caught
            raise ConfigError(
                f"preempt_signals: {name!r} is not a signal a process can catch; e.g. SIGTERM, SIGUSR1"
            )


def _check_blocks(b: BlocksConfig) -> None:
    """The block list, activation checkpointing (a bool means full or none) and the compile and
    tiling settings."""
    if isinstance(b.wrap, (str, type)):
        b.wrap = (b.wrap,)
    b.wrap = tuple(b.wrap)
    for item in b.wrap:
        if not isinstance(item, (str, type)):
            raise ConfigError(f"wrap entries must be module classes or class names, got {item!r}")
    ac = b.activation_checkpointing
    if isinstance(ac, bool):
        b.activation_checkpointing = "full" if ac else "none"
    _choice("activation_checkpointing", b.activation_checkpointing, get_args(CheckpointingName))
    every = b.activation_checkpointing_every
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"activation_checkpointing_every={every!r} must be an integer >= 1 (or None)")
        if b.activation_checkpointing != "selective":
            raise ConfigError(
                f"activation_checkpointing_every={every} applies to activation_checkpointing: selective "
                f"only (it is {b.activation_checkpointing!r}); set it to selective or drop the setting")
    for name in ("compile", "compile_fullgraph"):
        if not isinstance(getattr(b, name), bool):
            raise ConfigError(f"{name}={getattr(b, name)!r} must be true or false")
    if b.compile_dynamic is not None and not isinstance(b.compile_dynamic, bool):
        raise ConfigError(f"compile_dynamic={b.compile_dynamic!r} must be true, false or None")
    _check_tiles(b)
    modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    if b.compile_mode is not None:
        _choice("compile_mode", b.compile_mode, modes)
    if not isinstance(b.compile_backend, str) or not b.compile_backend:
        raise ConfigError(f"compile_backend={b.compile_backend!r} must name a torch.compile backend "
                          "(e.g. inductor)")


def _check_tiles(b: BlocksConfig) -> None:
    for name in ("tiled_mlp", "tiled_loss"):
        if getattr(b, name) is not None and not isinstance(getattr(b, name), bool):
            raise ConfigError(f"{name}={getattr(b, name)!r} must be true, false or None (on under context "
                              "parallelism)")
    tile = b.tile_tokens
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ConfigError(f"tile_tokens={tile!r} must be an integer >= 1")


def _check_compile(cfg: EngineConfig) -> None:
    """compile: true: a backend that compiles blocks, a torch.compile backend torch has here, a
    mode only inductor takes."""
    blocks, backend = cfg.blocks, cfg.sharding.backend
    if not backend_spec(backend).compiles_blocks:
        raise ConfigError(f"compile: true is not supported with backend: {backend} (its engine wraps the "
                          "model itself); use backend: torch to compile each block, or compile: false")
    import torch

    known = torch.compiler.list_backends(exclude_tags=())
    if blocks.compile_backend not in known:
        raise ConfigError(f"compile_backend={blocks.compile_backend!r} is not a torch.compile backend of "
                          f"this torch ({torch.__version__}); choose one of: "
                          f"{', '.join(sorted({*torch.compiler.list_backends(), 'aot_eager', 'eager'}))}")
    if blocks.compile_mode not in (None, "default") and blocks.compile_backend != "inductor":
        raise ConfigError(f"compile_mode={blocks.compile_mode!r} is an inductor setting; drop compile_mode "
                          f"or use compile_backend: inductor (it is {blocks.compile_backend!r})")
