"""Tiny models, data, the plain single-process reference, and the same loop on shardwise.

The contract under test: a prepared DataLoader with per-process batch B on W processes yields
global batch k = samples [kWB, (k+1)WB) of the permutation torch.randperm(n, seed + epoch), so
one plain process with batch W*B over that permutation sees the same global batches.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ = 64, 8
SEED = 0
# The strategies every equivalence check covers (the core issue's list).
STRATEGIES: list[dict[str, str]] = [
    {"strategy": "ddp"},
    {"strategy": "zero1"},
    {"strategy": "zero2"},
    {"strategy": "zero3"},
    {"strategy": "zero2", "offload": "optimizer"},
    {"strategy": "zero3", "offload": "optimizer"},
    {"strategy": "zero3", "offload": "params"},
]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Our own small model: embedding, repeated residual blocks, norm, head."""

    def __init__(self, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


@dataclass(frozen=True, slots=True)
class Trained:
    """One training run: the micro-batch losses (averaged over processes), the norms of the
    clipped steps, the memory report after the last step (None: a plain process), the final full
    weights (None: not taken). Module-level, so it pickles back from spawned workers."""

    losses: list[float]
    norms: list[float] = field(default_factory=list)
    memory: Any = None
    state: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """A checkpoint test's run (`checkpoint_loop`): its losses (averaged over processes), the final
    full weights, `engine.step` at the end, the scheduler's last LRs (None: not taken)."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    step: int
    lr: list[float] | None = None


# Records that scripts started by a launcher save with torch.save (they run as __main__, so their
# records live here, where the test process finds them by this module's name).
@dataclass(frozen=True, slots=True)
class Launched:
    """What tests/scripts/train_from_config.py saves (rank 0): the losses, clip norms and final
    weights of its run, the resolved config, the world size; with --config-optimizer the LR after
    each optimizer step and the class of the optimizer the config built (no norms then)."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    config: dict[str, Any]
    world: int
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    optimizer: str | None = None


@dataclass(frozen=True, slots=True)
class Groups:
    """The mesh every sharded parameter lives on: its placements (sorted kinds and dims), the
    shard and replicate groups as global ranks, and the share of the parameters this rank holds."""

    meshes: list[tuple[tuple[str, int | None], ...]]
    shard: list[int]
    replicate: list[int]
    share: float


@dataclass(frozen=True, slots=True)
class NodeRun:
    """What tests/test_multinode.py's worker saves, each rank: where it ran (rank, world, the node
    its launcher stands for, the launcher's local world size), its groups, the losses (averaged
    over processes), the resolved config, the final full weights (rank 0; None elsewhere), the
    gradient norms `clip_grad_norm_` returned (before clipping)."""

    rank: int
    world: int
    node: int
    local_world_size: int
    groups: Groups
    losses: list[float]
    config: dict[str, Any]
    state: dict[str, torch.Tensor] | None = None
    norms: list[float] = field(default_factory=list)  # the clipped steps' gradient norms


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name == "tiny":
        return TinyLM()
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        )
        return GPT2LMHeadModel(cfg)
    if name == "gpt":  # examples/gpt.py: a plain-torch GPT carrying its own tensor-parallel plan
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from gpt import GPT

        return GPT(vocab=VOCAB, d=32, layers=2, heads=2, block=SEQ)
    if name == "llama":  # its own tensor-parallel plan (base_model_tp_plan); 4 heads, 2 key/value heads
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                            tie_word_embeddings=False)
        return LlamaForCausalLM(llama)
    raise ValueError(name)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    takes_keyword = "input_ids" in inspect.signature(model.forward).parameters  # (examples/gpt.py: ids)
    out = model(input_ids=ids) if takes_keyword else model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)
    )


class Tokens(Dataset):
    def __init__(self, n: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def param_groups(model: nn.Module, wd: float = 0.1) -> list[dict[str, Any]]:
    """Two groups: weight decay on matrices, none on biases and norms."""
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=1e-3)


Clip = float | None | dict[int, float]  # one bound for every step, none, or bounds by optimizer step


def bound_at(clip: Clip, step: int) -> float | None:
    """The clip bound of optimizer step `step` (None: that step is not clipped)."""
    return clip.get(step) if isinstance(clip, dict) else clip


def reference(
    name: str, *, world: int, batch: int, accum: int, steps: int, clip: Clip = 1.0, device: str = "cpu"
) -> dict[str, Any]:
    """One plain process on the same global batches: micro-batch losses, norms (of the clipped
    steps), final weights."""
    model = build(name).to(device)
    opt = make_optimizer(model)
    data = Tokens(world * batch * accum * steps)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED)).tolist()
    g = world * batch
    losses, norms = [], []
    for k in range(accum * steps):
        ids = data.data[order[k * g : (k + 1) * g]].to(device)
        loss = lm_loss(model, ids)
        (loss / accum).backward()
        losses.append(loss.item())
        if (k + 1) % accum == 0:
            bound = bound_at(clip, k // accum)
            if bound is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), bound).item())
            opt.step()
            opt.zero_grad()
    return Trained(losses, norms, state={k: v.detach().cpu().clone() for k, v in model.state_dict().items()})


def train_engine(
    name: str, engine_kw: dict[str, Any], *, batch: int, accum: int, steps: int, clip: Clip = 1.0
) -> Trained:
    """The same loop written against shardwise (optimizer created before prepare)."""
    import shardwise

    engine = shardwise.Engine(grad_accum_steps=accum, seed=SEED, **engine_kw)
    return run_loop(engine, name, batch=batch, steps=steps, clip=clip)


def run_loop(engine: Any, name: str, *, batch: int, steps: int, clip: Clip = 1.0) -> Trained:
    """The training loop of `train_engine`, on an engine configured elsewhere (a config file)."""
    model, opt, loader = prepared(engine, name, batch=batch, steps=steps)
    return replace(train(engine, model, opt, loader, clip=clip), state=engine.get_state_dict(model))


def prepared(engine: Any, name: str, *, batch: int, steps: int) -> tuple[Any, Any, Any]:
    """`name`, its AdamW and a shuffled loader of `steps` optimizer steps, prepared on `engine`."""
    accum = engine.config.training.grad_accum_steps
    model = build(name)
    opt = make_optimizer(model)
    data = Tokens(engine.num_processes * batch * accum * steps)
    return engine.prepare(model, opt, DataLoader(data, batch_size=batch, shuffle=True))


def train(engine: Any, model: Any, opt: Any, loader: Any, *, clip: Clip = 1.0,
          at_step: Callable[[], None] | None = None) -> Trained:
    """One pass over `loader` with the Engine's verbs: losses (averaged over processes), the
    clipped norms, the memory report after the last step; `at_step()` after each optimizer step."""
    accum = engine.config.training.grad_accum_steps
    losses, norms, memory = [], [], None
    for i, ids in enumerate(loader):
        with engine.accumulate(model):
            loss = lm_loss(model, ids)
            engine.backward(loss)
            losses.append(engine.reduce(loss.detach(), "mean").item())
            bound = bound_at(clip, i // accum)
            if engine.sync_gradients and bound is not None:  # None: the script does not clip
                norms.append(float(engine.clip_grad_norm_(model.parameters(), bound)))
            opt.step()
            if i == len(loader) - 1:
                memory = engine.memory_report()  # after the last step, gradients still held
            opt.zero_grad()
            if at_step is not None and engine.sync_gradients:
                at_step()
    return Trained(losses, norms, memory)


def checkpoint_loop(engine: Any, steps: int, *, n: int, global_batch: int, name: str = "tiny",
                    load: str | None = None, after_load: Callable[[], None] | None = None,
                    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    at_step: Callable[[int, Any, Any], None] | None = None,
                    until_step: bool = False) -> tuple[list[float], Any, Any, Any]:
    """The checkpoint tests' loop: `name`, AdamW, a StepLR (gamma 0.9) and a shuffled loader of
    `n` samples in global batches of `global_batch`, prepared on `engine`; resumed from `load`
    (then `after_load()`); `steps` optimizer steps (`until_step`: until engine.step is `steps`),
    clipped at 1.0; `transform(ids)` on each batch; `at_step(steps taken here, model, opt)` after
    each step. Returns the losses (averaged over processes), the model, optimizer and scheduler."""
    model = build(name)
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = DataLoader(Tokens(n), batch_size=global_batch // engine.num_processes, shuffle=True)
    model, opt, sched, loader = engine.prepare(model, opt, sched, loader)
    if load:
        engine.load_state(load)
        if after_load is not None:
            after_load()
    losses: list[float] = []

    def done() -> bool:
        return (engine.step if until_step else len(losses)) >= steps

    while not done():
        for ids in loader:
            if transform is not None:
                ids = transform(ids)
            loss = lm_loss(model, ids)
            engine.backward(loss)
            engine.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
            if at_step is not None:
                at_step(len(losses), model, opt)
            if done():
                break
    return losses, model, opt, sched


def one_step(engine: Any, name: str) -> tuple[Any, Any]:
    """Prepare `name` with AdamW and take one optimizer step on 2 samples per process."""
    model = build(name)
    opt = make_optimizer(model)
    model, opt = engine.prepare(model, opt)
    ids = Tokens(4).data[engine.process_index * 2 : engine.process_index * 2 + 2]
    engine.backward(lm_loss(model, ids))
    opt.step()
    return model, opt


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference over every tensor; keys and shapes must match (a
    broadcast would hide a wrong shape)."""
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    shapes = {k: (tuple(a[k].shape), tuple(b[k].shape)) for k in a if a[k].shape != b[k].shape}
    assert not shapes, f"shapes differ: {shapes}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def close(xs: list[float], ys: list[float]) -> float:
    assert len(xs) == len(ys), (len(xs), len(ys))
    return max(abs(x - y) for x, y in zip(xs, ys)) if xs else 0.0


def check_matches(run: Any, ref: Any, label: str, model: str) -> None:
    """A run's micro-batch losses, clipped norms and final weights against one plain process's
    (`Trained`-like: losses, norms, state), 1e-5, 1e-5 x the largest norm and 2e-5, each named
    in its message; and training moved the weights (the comparison is not trivially true)."""
    assert len(run.losses) == 8 and len(run.norms) == 4
    where = f"{label}: " if label else ""
    losses, weights = close(run.losses, ref.losses), max_diff(run.state, ref.state)
    assert losses < 1e-5, f"{where}losses {losses:.2e} from one process's"
    assert close(run.norms, ref.norms) < 1e-5 * max(ref.norms), \
        f"{where}clipped norms {close(run.norms, ref.norms):.2e} from one process's"
    assert weights < 2e-5, f"{where}weights {weights:.2e} from one process's"
    assert max_diff(run.state, build(model).state_dict()) > 1e-3, f"{where}the weights never moved"


def train_plain(model: nn.Module, batches: Any, lr: float,
                loss_of: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
                ) -> dict[str, Any]:
    """One plain process: AdamW at `lr` over `batches` (dicts, `model(**batch).loss`, or
    `loss_of(model, batch)`), the gradient clipped at 1.0 each step: its losses, clipped norms and
    final weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch).loss if loss_of is None else loss_of(model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state}


def is_finite(xs: list[float]) -> bool:
    return all(math.isfinite(x) for x in xs)


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})


def plain_reference(steps: int, n: int, batch: int, device: torch.device | str = "cpu") -> Trained:
    """One plain process over the global batches a seeded loader of `n` samples serves in
    batches of `batch` (the permutation `randperm(n, SEED + epoch)`), clipping at 1.0 and an LR
    decayed 0.9 per step: the checkpoint tests' reference (losses and final weights, on the host;
    no norms), computed on `device`."""
    model = build("tiny").to(device)
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    data, losses = Tokens(n).data.to(device), []
    for epoch in range(2):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        for k in range(n // batch):
            loss = lm_loss(model, data[order[k * batch : (k + 1) * batch]])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                return Trained(losses, state={k: v.cpu() for k, v in model.state_dict().items()})
    raise AssertionError(f"{steps} steps need more than two epochs of {n} samples")


def held_elements(model: nn.Module) -> int:
    """Parameter elements whose storage this process holds, each storage once (fp32: bytes / 4)."""
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors += [p, getattr(p, "ds_tensor", p)]
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        for group in state._fsdp_param_groups if state is not None else []:
            for fp in group.fsdp_params:
                tensors += [fp.sharded_param, getattr(fp, "_unsharded_param", fp.sharded_param)]
    seen, total = set(), 0
    for t in tensors:
        s = getattr(t, "_local_tensor", t).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total // 4


def adam_state_elements(optimizer: Any) -> int:
    """fp32 elements of Adam's moments (`exp_avg`, `exp_avg_sq`) this process really holds, as
    its prepared optimizer's `state_dict()` reaches them: each storage once, by its bytes / 4 (a
    state that is a view of a larger storage counts the whole storage; a DTensor its local one)."""
    seen: dict[int, int] = {}

    def walk(value: Any, key: Any = None) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, key)
        elif torch.is_tensor(value) and key in ("exp_avg", "exp_avg_sq"):
            local = value._local_tensor if hasattr(value, "_local_tensor") else value
            assert local.dtype == torch.float32, (key, local.dtype)
            storage = local.untyped_storage()
            seen[storage._cdata] = storage.nbytes()

    walk(optimizer.state_dict())
    return sum(seen.values()) // 4


def one_line(err: BaseException | str) -> str:
    """A refusal's message, asserted to be one line (`pytest.raises(match=)` would pass a message
    with a second line, and a message split over lines reads as two log records)."""
    message = str(err)
    assert message.strip(), f"an empty message ({type(err).__name__})"
    assert "\n" not in message, f"not one line: {message!r}"
    return message
