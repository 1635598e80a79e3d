"""Big models from the first byte: built empty, initialized shard by shard, loaded slice by slice.

- Init invariance: a model built under `engine.init_empty()` comes out bit-identical at 1, 2 and
  4 processes under ddp, zero2 and zero3 (gathered), no two shards of a randomly initialized
  parameter are copies, and it equals a normal build with the same seed at every process count:
  our own model, one that initializes in its constructor (zeroed head, raw parameters,
  trunc_normal_, orthogonal_, a random buffer between them: test_init_and_load.OwnInit), and
  `transformers` GPT-2 and Llama (post_init). Buffers: a non-persistent buffer computed in the
  constructor (kept real by init_empty) and a `transformers` Llama built under
  `torch.device("meta")` (rotary cache recomputed by its `_init_weights`) come out as in a
  normal build.
- Loading: a `transformers` GPT-2 saved by one plain process with `save_pretrained` (3 files)
  loads under every strategy (DeepSpeed in test_deepspeed.py), bit-identical when gathered, and
  two steps after it match one plain process that loaded the same files (losses 1e-5, weights
  2e-5, the equivalence tests' tolerances).
- Bad sources are refused with one line naming the file or key, before any weight changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from test_init_and_load import OwnInit
from torch import nn

INIT_STRATEGIES = ["ddp", "zero2", "zero3"]
LOAD_CONFIGS = [*W.STRATEGIES]  # ddp, zero1, zero2, zero3, both optimizer offloads, params offload
STEPS, BATCH = 2, 2  # optimizer steps after loading; samples per process per step


class Rotary(nn.Module):
    """A block with a non-persistent buffer computed in its constructor (a rotary cache)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("cos", torch.cos(torch.outer(torch.arange(16).float(), inv)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.cos[: x.shape[-2], :1]


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Rotary() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=W.VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=16))


def _gathered(engine: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    state = engine.get_state_dict(model)
    buffers = {f"buffer:{n}": b.detach().cpu().clone() for n, b in engine.unwrap_model(model).named_buffers()}
    return {**state, **buffers}


@dataclass(frozen=True, slots=True)
class Init:
    """A model built empty and prepared: its gathered weights and buffers ("buffer:NAME"), and
    this process's shards of its sharded parameters (None: not taken)."""

    state: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor] | None = None


def _init_all() -> dict[tuple[str, str], Init]:
    import shardwise

    out: dict[tuple[str, str], Init] = {}
    for strategy in INIT_STRATEGIES:
        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED)
        for name, build in (("tiny", lambda: W.TinyLM()), ("gpt2", lambda: W.build("gpt2")),
                            ("rotary", WithRotary), ("own", OwnInit), ("llama_empty", tiny_llama)):
            torch.manual_seed(1234)
            with engine.init_empty():
                model = build()
            assert all(p.is_meta for p in model.parameters())
            model = engine.prepare(model)
            local = {n: p._local_tensor.clone() for n, p in model.named_parameters()
                     if hasattr(p, "_local_tensor")}
            out[(strategy, name)] = Init(_gathered(engine, model), local)
        with torch.device("meta"):  # built by the user on the meta device: buffers too
            llama = tiny_llama()
        out[(strategy, "llama")] = Init(_gathered(engine, engine.prepare(llama)))
    return out


@pytest.fixture(scope="module")
def inits() -> dict[int, list[dict[tuple[str, str], Init]]]:
    return {world: spawn(_init_all, world) for world in (1, 2, 4)}


@pytest.mark.parametrize("name", ["tiny", "gpt2", "rotary", "llama", "own", "llama_empty"])
def test_empty_init_does_not_depend_on_world_size_or_strategy(inits: dict, name: str) -> None:
    first = inits[1][0][("ddp", name)].state
    assert first and all(torch.isfinite(v.float()).all() for v in first.values())
    for world, ranks in inits.items():
        for strategy in INIT_STRATEGIES:
            state = ranks[0][(strategy, name)].state
            assert state.keys() == first.keys()
            for k in first:
                assert torch.equal(state[k], first[k]), (world, strategy, name, k)


@pytest.mark.parametrize("world", [2, 4])
def test_no_two_shards_are_copies(inits: dict, world: int) -> None:
    for strategy in ("zero2", "zero3"):
        for name in ("tiny", "gpt2"):
            full = inits[1][0][("ddp", name)].state
            shards = [rank[(strategy, name)].local for rank in inits[world]]
            checked = 0
            for k, value in full.items():
                if k not in shards[0] or value.unique().numel() < 2 or value.shape[0] < world:
                    continue  # constants (norm weights) are equal everywhere, as they should be
                for a in range(world):
                    for b in range(a + 1, world):
                        if shards[a][k].shape == shards[b][k].shape:
                            assert not torch.equal(shards[a][k], shards[b][k]), (strategy, name, k, a, b)
                checked += 1
            assert checked >= 5, (strategy, name)


@pytest.mark.parametrize("name", ["tiny", "gpt2", "rotary", "own", "llama_empty"])
def test_empty_init_equals_a_normal_build(inits: dict, name: str) -> None:
    """init_empty + prepare gives the weights and buffers of a normal build with the same seed,
    bit for bit, at every process count and strategy (issue 21, item 5); so do the buffers of a
    `transformers` model built on meta."""
    check_normal_build(inits, name, INIT_STRATEGIES)
    if name == "own":
        assert float(inits[1][0][("ddp", "own")].state["head.weight"].abs().sum()) == 0.0  # zeroed head
    llama = tiny_llama()
    for n, b in llama.named_buffers():
        assert torch.equal(inits[1][0][("zero3", "llama")].state[f"buffer:{n}"], b), n


def check_normal_build(inits: dict, name: str, strategies: list[str]) -> None:
    """Every run's gathered weights and buffers equal a normal build's with the same seed."""
    builds = {"tiny": W.TinyLM, "gpt2": lambda: W.build("gpt2"), "rotary": WithRotary, "own": OwnInit,
              "llama_empty": tiny_llama}
    torch.manual_seed(1234)
    normal = builds[name]()
    want = {**normal.state_dict(), **{f"buffer:{n}": b for n, b in normal.named_buffers()}}
    for world, ranks in inits.items():
        for strategy in strategies:
            got = ranks[0][(strategy, name)].state
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert differ == [], f"{world} processes, {strategy}, {name}: unlike a normal build's: {differ}"


def _planted_gpt2(name: str = "gpt2") -> dict[tuple[str, str], Init]:
    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    torch.manual_seed(1234)
    with engine.init_empty():  # (as the real test builds it)
        model = W.build("gpt2") if name == "gpt2" else WithRotary()
    model = engine.prepare(model)
    return {("zero3", name): Init(_gathered(engine, model))}


def test_an_empty_build_that_skips_the_recorded_init_is_caught() -> None:
    ranks = spawn(planted(_planted_gpt2, "recipes_not_replayed"), 2)
    caught(check_normal_build, {2: ranks}, "gpt2", ["zero3"],
           must=r"2 processes, zero3, gpt2: unlike a normal build's: \['transformer\.wte\.weight'")


def test_an_empty_build_that_replaces_its_buffers_is_caught() -> None:
    """`empty_buffers_replaced`: the computed rotary buffer lost at allocation; the normal-build
    check (buffers included) fails."""
    ranks = spawn(planted(_planted_gpt2, "empty_buffers_replaced"), 2, "rotary")
    caught(check_normal_build, {2: ranks}, "rotary", ["zero3"],
           must=r"2 processes, zero3, rotary: unlike a normal build's: \['buffer:blocks\.0\.cos'")


# -- loading pretrained weights ------------------------------------------------------------------
def save_pretrained_gpt2(folder: Path) -> Path:
    """A GPT-2 saved by one plain process, in 3 files, trained a step so it is not an init."""
    model = W.build("gpt2")
    torch.manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = folder / "gpt2-pretrained"
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def plain_steps(path: Path, world: int) -> W.Trained:
    """One plain process: load the files, train STEPS steps on the global batches."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path)
    opt = W.make_optimizer(model)
    data = W.Tokens(STEPS * world * BATCH).data
    losses = []
    for step in range(STEPS):
        loss = W.lm_loss(model, data[step * world * BATCH : (step + 1) * world * BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return W.Trained(losses, state={k: v.detach().clone() for k, v in model.state_dict().items()})


def shardwise_steps(engine: Any, model: nn.Module, opt: Any) -> W.Trained:
    data = W.Tokens(STEPS * engine.num_processes * BATCH).data
    losses = []
    for step in range(STEPS):
        batch = data[step * engine.num_processes * BATCH : (step + 1) * engine.num_processes * BATCH]
        mine = batch[engine.process_index * BATCH : (engine.process_index + 1) * BATCH]
        loss = W.lm_loss(model, mine)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    return W.Trained(losses, state=engine.get_state_dict(model))


@dataclass(frozen=True, slots=True)
class Loaded:
    """Pretrained weights loaded under one config: the gathered weights right after loading, then
    the losses and gathered weights of STEPS steps."""

    loaded: dict[str, torch.Tensor]
    losses: list[float]
    state: dict[str, torch.Tensor]


def _loaded(engine: Any, model: nn.Module, opt: Any) -> Loaded:
    loaded = engine.get_state_dict(model)
    steps = shardwise_steps(engine, model, opt)
    return Loaded(loaded, steps.losses, steps.state)


def load_runs(backend: str, configs: list[dict[str, str]], path: str) -> dict[tuple[str, str], Loaded]:
    """Under each config: load_model into a prepared model, then from_pretrained + prepare;
    gathered weights right after loading, and two steps after."""
    from transformers import GPT2LMHeadModel

    import shardwise

    out: dict[tuple[str, str], Loaded] = {}
    for cfg in configs:
        key = "+".join(cfg.values())
        engine = shardwise.Engine(backend=backend, cpu=True, seed=W.SEED, **cfg)
        torch.manual_seed(5)
        model = W.build("gpt2")  # other weights than the files'
        opt = W.make_optimizer(model)
        model, opt = engine.prepare(model, opt)
        engine.load_model(model, path)
        out[(key, "load_model")] = _loaded(engine, model, opt)
        engine = shardwise.Engine(backend=backend, cpu=True, seed=W.SEED, **cfg)
        model = engine.from_pretrained(GPT2LMHeadModel, path)
        opt = W.make_optimizer(model)  # made over the empty model, rebound at prepare
        model, opt = engine.prepare(model, opt)
        out[(key, "from_pretrained")] = _loaded(engine, model, opt)
    return out


def check_load_runs(runs: dict[tuple[str, str], Loaded], path: Path, configs: list[dict[str, str]]) -> None:
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        saved.update(load_file(f))
    assert len(list(path.glob("*.safetensors"))) >= 2  # a sharded save
    ref = plain_steps(path, 2)
    for cfg in configs:
        for way in ("load_model", "from_pretrained"):
            run = runs[("+".join(cfg.values()), way)]
            for k, v in saved.items():  # the files' tensors, bit for bit
                assert torch.equal(run.loaded[k], v), f"{cfg} {way}: {k} loaded unlike the file's"
            assert torch.equal(run.loaded["lm_head.weight"], saved["transformer.wte.weight"])  # tied
            assert W.close(run.losses, ref.losses) < 1e-5, (cfg, way)
            assert W.max_diff(run.state, ref.state) < 2e-5, (cfg, way)
            assert W.max_diff(run.state, run.loaded) > 1e-4  # the two steps moved the weights


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_gpt2(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def loads(pretrained: Path) -> dict[tuple[str, str], Loaded]:
    return spawn(load_runs, 2, "torch", LOAD_CONFIGS, str(pretrained))[0]


def test_pretrained_weights_load_under_every_strategy(loads: dict, pretrained: Path) -> None:
    check_load_runs(loads, pretrained, LOAD_CONFIGS)


def test_every_rank_reading_the_first_rows_is_caught(pretrained: Path) -> None:
    zero3 = [{"strategy": "zero3"}]
    runs = spawn(planted(load_runs, "load_rows_from_zero"), 2, "torch", zero3, str(pretrained))[0]
    caught(check_load_runs, runs, pretrained, zero3,
           must=r"^\{'strategy': 'zero3'\} load_model: \S+ loaded unlike the file's")


# -- bad sources ----------------------------------------------------------------------------------
def _break(pretrained: Path, folder: Path, case: str) -> tuple[Path, str]:
    """A broken copy of the pretrained folder (or another source); what the one line must say."""
    import shutil

    target = folder / case.replace(" ", "_")
    shutil.copytree(pretrained, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    if case == "missing file":
        (target / files[1]).unlink()
        return target, f"{target / files[1]}: missing (named in model.safetensors.index.json)"
    if case == "truncated file":
        data = (target / files[0]).read_bytes()
        (target / files[0]).write_bytes(data[: len(data) - 100])
        return target, f"{target / files[0]}: truncated"
    if case in ("missing key", "extra key", "wrong shape"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(target / files[0])
        victim = min(tensors)
        if case == "missing key":
            del tensors[victim]
            del index["weight_map"][victim]
            needle = f"missing {victim}"
        elif case == "extra key":
            tensors["transformer.h.9.mlp.c_fc.weight"] = torch.zeros(2, 2)
            index["weight_map"]["transformer.h.9.mlp.c_fc.weight"] = files[0]
            needle = "unexpected transformer.h.9.mlp.c_fc.weight"
        else:
            tensors[victim] = torch.zeros(*tensors[victim].shape[:-1], tensors[victim].shape[-1] + 1)
            needle = f"mis-shaped {victim}"
        save_file(tensors, target / files[0], metadata={"format": "pt"})
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
        return target, needle
    if case == "another model":
        from safetensors.torch import save_file

        shutil.rmtree(target)
        target.mkdir()
        save_file(W.TinyLM().state_dict(), target / "model.safetensors")
        return target, "does not match GPT2LMHeadModel: missing transformer."
    if case == "no weights here":
        for f in target.iterdir():
            f.unlink()
        (target / "notes.txt").write_text("x")
        return target, "holds no model.safetensors and no model.safetensors.index.json (found notes.txt)"
    raise ValueError(case)


BAD_SOURCES = ["missing file", "truncated file", "missing key", "extra key", "wrong shape", "another model",
               "no weights here"]


@dataclass(frozen=True, slots=True)
class BadLoads:
    """Each case's error message (None: it loaded), and whether the weights stayed as they were."""

    messages: dict[str, str | None]
    unchanged: bool


def _bad_loads(cases: list[tuple[str, str]]) -> BadLoads:
    import shardwise
    from shardwise.checkpoint.sharded import CheckpointError

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    model = engine.prepare(W.build("gpt2"))
    before = engine.get_state_dict(model)
    messages: dict[str, str | None] = {}
    for case, path in cases:
        try:
            engine.load_model(model, path)
            messages[case] = None
        except CheckpointError as err:
            messages[case] = str(err)
    after = engine.get_state_dict(model)  # a collective: every process calls it
    return BadLoads(messages, W.max_diff(after, before) == 0.0 if engine.is_main_process else True)


def test_bad_sources_are_refused_before_any_weight_changes(pretrained: Path, tmp_path: Path) -> None:
    broken = {case: _break(pretrained, tmp_path, case) for case in BAD_SOURCES}
    ranks = spawn(_bad_loads, 2, [(case, str(path)) for case, (path, _) in broken.items()])
    check_bad_sources(broken, ranks)


def test_planted_load_not_strict_is_caught(pretrained: Path, tmp_path: Path) -> None:
    """`load_not_strict`: a source missing a key loads with a warning; the check wants the refusal."""
    broken = {case: _break(pretrained, tmp_path, case) for case in ("missing key",)}
    ranks = spawn(planted(_bad_loads, "load_not_strict"), 2, [(c, str(p)) for c, (p, _) in broken.items()])
    caught(check_bad_sources, broken, ranks,
           must=r"^missing key: the refusal on each process: \[None, None\]")


def check_bad_sources(broken: dict[str, tuple[Path, str]], ranks: list[BadLoads]) -> None:
    """Each case refused on every process, the same one line holding its words; no weight moved."""
    for case, (_, needle) in broken.items():
        messages = [r.messages[case] for r in ranks]
        assert messages[0] is not None and all(m == messages[0] for m in messages), \
            f"{case}: the refusal on each process: {messages}"
        assert "\n" not in messages[0] and needle in messages[0], (case, messages[0])
    assert all(r.unchanged for r in ranks)
