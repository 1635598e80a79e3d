"""Expert parallelism (`expert_parallel_size`) against one plain process (fp32).

Tiny transformers Mixtral (4 experts, top 2) and Qwen2-MoE (4 experts, top 2, a shared expert
outside `experts`), 2 layers, and a user's own model whose experts module declares the same
layout (`OwnMoE`), sequences of 16 tokens, 3 AdamW steps at lr 1e-2 from an unchanged
loop (`model(**batch).loss`, `engine.backward`, `clip_grad_norm_`, `opt.step`), the router's
load-balancing loss off unless said:
  2 processes   ep 2 under zero3 and zero2, both families, and with offload (Mixtral zero3 +
                params, Qwen2-MoE zero2 + optimizer): the mean of the ranks' losses and the
                clipped gradient norms within 1e-5 of one process on the global batch, the final
                weights (gathered, the model's own names and shapes) within 5e-5; each rank holds
                exactly half of every experts tensor (its local bytes measured); with the
                load-balancing loss on (a statistic of each rank's batch, so no data-parallel run
                equals one process), Mixtral ep 2 against zero3 without expert parallelism at the
                same 2 processes, within 1e-5. A checkpoint ep 2 -> plain zero3 -> ep 2, each load
                bit-identical to what was saved, the step after the round trip the straight run's.
                `save_model` reloaded by `from_pretrained` in one process: equal logits. Tokens per
                expert per step in the metrics records (the first step's equal to one process's
                routing of the same batch) and the report's plot. The bytes the all-to-alls send
                between ranks in the first step: 4 hidden-size rows per token slot routed to the
                other rank (one process's routing of the same batch), and nothing else.
  4 processes   ep 4 under zero2 (one expert per rank; both families) and zero3 (Mixtral); ep 2 x data 2 under
                zero3, Mixtral and Qwen2-MoE (each rank's 2 experts sharded again over the 2
                ranks that hold them, FSDP over the edp mesh): the same tolerances, each rank
                holding a quarter of every experts tensor. Hybrid sharding (2 replicas of 2) with
                ep 2 under zero3 (Mixtral): each rank holds half of every experts tensor, the
                replicas' expert gradients summed; the same with 2 micro-batches per step
                against one process on the step's 16 samples (summed once, at the synced one).
                Planted: the replicas' expert gradients never summed: the hybrid check fails.
                zero1 (DDP leaves the split experts out): Mixtral and Qwen2-MoE + optimizer
                offload at 2, ep 2 x data 2 (the 2 holders of each expert sum its gradients and
                split its optimizer steps) and ep 4 at 4, hybrid 2 replicas of 2, 2 micro-batches
                per step; the optimizer state held once per sharding group (counted); a
                checkpoint zero1 ep 2 x data 2 -> zero3 ep 4 -> back.
  8 processes   hybrid sharding 2 replicas of 4 with ep 2 below the group (the experts' FSDP
                units hybrid over replicas and holders): zero3, zero1, zero2 with 2 micro-batches
                per step, a checkpoint round trip through zero2 ep 4, an init_empty build.
  init_empty    Mixtral zero3 and Qwen2-MoE zero2 at ep 2, Mixtral ep 2 x data 2 at 4 (zero3
                and zero1): a normal build's weights bit for bit, each rank holding its share of
                every experts tensor; `engine.from_pretrained` of the export, and of transformers'
                own save_pretrained (the experts stored one by one, both families), read into
                the ep 2 split bit for bit.
  planted       the experts' gradients left undivided (summed over the ranks' tokens, not
                averaged): the 2-process check fails; the split experts of an empty build
                losing their recorded init: the init_empty check fails; zero1's holders not
                summing, or each stepping its experts whole; experts read one by one fused in
                the wrong order; hybrid experts' units left within each replica.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch import nn
from torch.utils.data import DataLoader

SEQ, VOCAB, BATCH, STEPS, LR = 16, 64, 2, 3, 1e-2
LOSS_TOL, WEIGHT_TOL = 1e-5, 5e-5
TWO = [("mixtral", "zero3"), ("mixtral", "zero2"), ("qwen", "zero3"), ("qwen", "zero2"),
       ("mixtral", "zero3", "params"), ("qwen", "zero2", "optimizer"), ("own", "zero3"), ("mixtral", "zero1"),
       ("qwen", "zero1", "optimizer")]
FOUR = [("mixtral", "zero2", 4), ("mixtral", "zero3", 4), ("mixtral", "zero3", 2), ("qwen", "zero3", 2),
        ("qwen", "zero2", 4), ("mixtral", "zero1", 2), ("qwen", "zero1", 4)]


def build(family: str, aux: bool = False) -> nn.Module:
    torch.manual_seed(1234)
    if family in ("own", "skewed"):
        return OwnMoE(skewed=family == "skewed")
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=SEQ,
            output_router_logits=aux, tie_word_embeddings=False))
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ, output_router_logits=aux,
        tie_word_embeddings=False))


class OwnExperts(nn.Module):
    """A user's own experts module in transformers' fused layout (`gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I], `num_experts`, `act_fn`) with its own loop over the experts."""

    def __init__(self, experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts, self.act_fn = experts, nn.SiLU()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class OwnMoE(nn.Module):
    """A user's own model: embedding, a top-2 router and OwnExperts, a head; `(input_ids,
    labels) -> loss` as transformers models are called."""

    def __init__(self, skewed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed, self.router = nn.Embedding(VOCAB, 32), nn.Linear(32, 4, bias=skewed)
        self.experts, self.head = OwnExperts(4, 32, 24), nn.Linear(32, VOCAB)
        if skewed:  # every token's top 2 are experts 0 and 1: experts 2 and 3 (rank 1's at ep 2) get none
            with torch.no_grad():
                self.router.bias.copy_(torch.tensor([20.0, 20.0, -20.0, -20.0]))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids).reshape(-1, 32)
        weights, chosen = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
        h = h + self.experts(h, chosen, weights / weights.sum(-1, keepdim=True))
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=nn.functional.cross_entropy(self.head(h), labels.reshape(-1)))


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": i, "labels": i} for i in ids]


@functools.cache
def reference(family: str, dp: int) -> dict[str, Any]:
    """One plain process on the global batches (dp x BATCH samples each, in order)."""
    return W.train_plain(build(family), DataLoader(samples(dp * BATCH * STEPS), batch_size=dp * BATCH), LR)


@functools.cache
def reference_per_rank(family: str, dp: int) -> dict[str, Any]:
    """One plain process with the router's load-balancing loss on, a statistic of each rank's
    batch: each step's loss is the mean of the dp ranks' losses, each on its BATCH samples of the
    global batch (what data parallelism averages), then one backward of that mean."""
    def mean_of_ranks(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [model(**{k: v[r * BATCH:(r + 1) * BATCH] for k, v in batch.items()}).loss for r in range(dp)]
        return sum(parts) / dp  # type: ignore[return-value]

    batches = DataLoader(samples(dp * BATCH * STEPS), batch_size=dp * BATCH)
    return W.train_plain(build(family, aux=True), batches, LR, mean_of_ranks)


def _prepared(family: str, strategy: str, ep: int, aux: bool = False, **extra: Any) -> tuple[Any, Any, Any]:
    import shardwise

    engine = shardwise.Engine(strategy=strategy, cpu=True, seed=0, expert_parallel_size=ep, **extra)
    model = build(family, aux)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = engine.prepare(model, opt)
    return engine, model, opt


def _step(engine: Any, model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    loss = model(**batch).loss
    engine.backward(loss)
    norm = float(engine.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad()
    return float(engine.reduce(loss.detach(), "mean")), norm


def _my_batches(engine: Any) -> list[dict[str, torch.Tensor]]:
    """This rank's share of each global batch (dp x BATCH samples, in order), as a loader gives it."""
    dp, rank = engine.parallel_dims.dp_size, engine.parallel_dims.dp_rank(engine.process_index)
    data = samples(dp * BATCH * STEPS)
    mine = [[data[s * dp * BATCH + rank * BATCH + j] for j in range(BATCH)] for s in range(STEPS)]
    return [{k: torch.stack([d[k] for d in step]) for k in data[0]} for step in mine]


def _train(family: str, strategy: str, offload: str = "none", *, ep: int,
           aux: bool = False, **extra: Any) -> dict[str, Any]:
    from shardwise.strategies.expert_parallel import sent_bytes

    engine, model, opt = _prepared(family, strategy, ep, aux, offload=offload, **extra)
    experts = [(p.to_local().numel(), p.numel()) for n, p in model.named_parameters() if "experts." in n]
    sent_bytes()
    steps, sent = [], []
    for b in _my_batches(engine):
        steps.append(_step(engine, model, opt, b))
        sent.append(sent_bytes())
    state = engine.get_state_dict(model)
    # zero1: the per-element optimizer state this rank keeps (AdamW: exp_avg, exp_avg_sq; local
    # shards), against the model's elements (DTensor: global)
    inner = engine.session.optimizers[0].runner._inner if strategy == "zero1" else []
    held = sum(v.numel() for o in inner for st in o.state.values() for v in st.values() if v.dim() > 0)
    numel = sum(p.numel() for p in model.parameters())
    engine.free_memory()
    return {"losses": [s[0] for s in steps], "norms": [s[1] for s in steps], "state": state,
            "experts": experts, "sent": sent, "opt_state": held, "numel": numel}


def _resume(folder: str, first: tuple[str, int] = ("zero3", 2),
            middle: tuple[str, int] = ("zero3", 1), **extra: Any) -> dict[str, Any]:
    """`first` (strategy, ep; with `extra`) -> `middle` -> `first` again, Mixtral (by default ep
    2 -> plain zero3 -> ep 2): each load bit-identical, the step after the round trip the
    straight run's."""
    engine, model, opt = _prepared("mixtral", *first, **extra)
    batches = _my_batches(engine)
    for b in batches[:-1]:
        _step(engine, model, opt, b)
    saved = engine.get_state_dict(model)
    engine.save_state(f"{folder}/ep2")
    straight = _step(engine, model, opt, batches[-1]), engine.get_state_dict(model)
    engine.save_model(model, f"{folder}/export")
    engine.free_memory()
    plain, model, opt = _prepared("mixtral", *middle)
    plain.load_state(f"{folder}/ep2")
    into_plain = plain.get_state_dict(model)
    plain.save_state(f"{folder}/plain")
    plain.free_memory()
    back, model, opt = _prepared("mixtral", *first, **extra)
    back.load_state(f"{folder}/plain")
    into_ep = back.get_state_dict(model)
    after = _step(back, model, opt, batches[-1]), back.get_state_dict(model)
    back.free_memory()
    return {"saved": saved, "into_plain": into_plain, "into_ep": into_ep, "straight": straight,
            "after": after}


def first_routes(family: str) -> list[torch.Tensor]:
    """Each MoE layer's chosen experts (tokens in sample order, k per token) in one process's
    first forward on the first global batch."""
    model, seen = build(family), []
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
    model(**next(iter(DataLoader(samples(2 * BATCH * STEPS), batch_size=2 * BATCH))))
    return seen


def _metrics(folder: str) -> dict[str, Any]:
    """ep 2, zero3, full activation checkpointing (each block's dispatch runs again in backward),
    a metrics record every step (jsonl), then the report of the run."""
    engine, model, opt = _prepared("mixtral", "zero3", 2, log_with="jsonl", project_dir=f"{folder}/logs",
                                   log_every_steps=1, progress=False, activation_checkpointing="full")
    engine.init_trackers("moe")
    steps = [_step(engine, model, opt, b) for b in _my_batches(engine)]
    state = engine.get_state_dict(model)
    engine.end_training()  # (the last run of the spawn: it ends the process group)
    return {"run": f"{folder}/logs/logs/moe", "losses": [s[0] for s in steps], "norms": [s[1] for s in steps],
            "state": state}


def _empty(family: str, strategy: str, ep: int, export: str | None = None, **extra: Any) -> dict[str, Any]:
    """The model built under `init_empty()` and prepared with expert parallelism (each rank's
    experts initialized from the constructor's own draws, its split only), and, given an
    export, `from_pretrained` reading it straight into the split: the gathered weights, and
    each rank's share of every experts tensor."""
    import shardwise

    out: dict[str, Any] = {}
    engine = shardwise.Engine(strategy=strategy, cpu=True, seed=0, expert_parallel_size=ep, **extra)
    with engine.init_empty():
        model = build(family)
    assert all(p.is_meta for p in model.parameters())
    model = engine.prepare(model)
    out["empty"] = engine.get_state_dict(model)
    out["experts"] = [(p.to_local().numel(), p.numel()) for n, p in model.named_parameters()
                      if "experts." in n]
    engine.free_memory()
    if export is not None:
        from transformers import MixtralForCausalLM

        engine = shardwise.Engine(strategy=strategy, cpu=True, seed=0, expert_parallel_size=ep)
        model = engine.prepare(engine.from_pretrained(MixtralForCausalLM, export))
        out["pretrained"] = engine.get_state_dict(model)
        engine.free_memory()
    return out


def _per_expert(folder: str, family: str, strategy: str) -> dict[str, Any]:
    """`engine.from_pretrained` of transformers' own save (the experts stored one by one), read
    into the ep 2 split: the gathered weights, and each rank's share of every experts tensor."""
    from transformers import AutoModelForCausalLM

    import shardwise

    engine = shardwise.Engine(strategy=strategy, cpu=True, seed=0, expert_parallel_size=2)
    model = engine.prepare(engine.from_pretrained(AutoModelForCausalLM, f"{folder}/hf_{family}"))
    out = {"empty": engine.get_state_dict(model),
           "experts": [(p.to_local().numel(), p.numel()) for n, p in model.named_parameters()
                       if "experts." in n]}
    engine.free_memory()
    return out


def _two(folder: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {case: _train(*case, ep=2) for case in TWO}
    out["aux"] = _train("mixtral", "zero3", ep=2, aux=True)
    out["aux", "qwen"] = _train("qwen", "zero1", ep=2, aux=True)
    out["aux", "tiled"] = _train("mixtral", "zero3", ep=2, aux=True, tiled_loss=True)
    out["skewed"] = _train("skewed", "zero3", ep=2)
    out["skewed", "zero1"] = _train("skewed", "zero1", ep=2)
    out["generate"] = {strategy: _generate(strategy) for strategy in ("zero1", "zero2", "zero3")}
    out["generate"]["zero1 without ep"] = _generate("zero1", ep=1)  # (DDP's wrapper: its generate served)
    out["accumulated"] = _counted_with_accumulation(folder)
    out["resume"] = _resume(folder)
    out["empty"] = _empty("mixtral", "zero3", 2, f"{folder}/export")
    out["empty", "qwen"] = _empty("qwen", "zero2", 2)
    out["per_expert", "mixtral"] = _per_expert(folder, "mixtral", "zero3")
    out["per_expert", "qwen"] = _per_expert(folder, "qwen", "zero1")
    out["metrics"] = _metrics(folder)
    return out


PROMPTS = torch.randint(0, VOCAB, (2, 2, 5), generator=torch.Generator().manual_seed(11))  # [rank, row, tok]
NEW_TOKENS = (3, 7)  # each rank's max_new_tokens: rank 0's generation ends first


def _generate(strategy: str, ep: int = 2) -> dict[str, Any]:
    """ep 2 (each forward's tokens dispatched over both ranks): each rank generates greedily from
    its own prompts with its own max_new_tokens, through the prepared model and through
    `unwrap_model`; the rank that finishes first keeps dispatching until the other is done."""
    engine, model, _ = _prepared("mixtral", strategy, ep)
    rank = engine.process_index
    prompts, new = PROMPTS[rank], NEW_TOKENS[rank]
    out = {"prepared": model.generate(prompts, max_new_tokens=new, do_sample=False, pad_token_id=0),
           "unwrapped": engine.unwrap_model(model).generate(prompts, max_new_tokens=new, do_sample=False,
                                                            pad_token_id=0)}
    engine.free_memory()
    return out


def generate_plain() -> list[torch.Tensor]:
    """One plain process's greedy generation from each rank's prompts and length."""
    model = build("mixtral")
    return [model.generate(PROMPTS[r], max_new_tokens=NEW_TOKENS[r], do_sample=False, pad_token_id=0)
            for r in range(2)]


def _counted_with_accumulation(folder: str) -> dict[str, Any]:
    """ep 2, zero3, 2 micro-batches per step, a metrics record every step: the tokens per expert
    of a step are those of both its micro-batches (and of both ranks)."""
    engine, model, opt = _prepared("mixtral", "zero3", 2, grad_accum_steps=2, log_with="jsonl",
                                   project_dir=f"{folder}/accumulated", log_every_steps=1, progress=False)
    engine.init_trackers("moe")
    rank = engine.process_index
    data = samples(2 * 2 * BATCH * STEPS)
    for s in range(STEPS):
        mine = data[(2 * s * 2 + 2 * rank) * BATCH:(2 * s * 2 + 2 * rank + 2) * BATCH]
        for micro in (mine[:BATCH], mine[BATCH:]):
            with engine.accumulate(model):
                engine.backward(model(**{k: torch.stack([d[k] for d in micro]) for k in data[0]}).loss)
                opt.step()
                opt.zero_grad()
    engine.free_memory()
    return {"run": f"{folder}/accumulated/logs/moe"}


def _accumulated(strategy: str, **extra: Any) -> dict[str, Any]:
    """ep 2, Mixtral, 2 micro-batches per step: hybrid sharding's replicas (zero3, 2 of 2) or
    zero1's edp ranks (DDP) sum the experts' gradients once, at the synced micro-step. 4 ranks x
    2 micro-batches of BATCH samples per step, the global batch of a dp 8 reference."""
    engine, model, opt = _prepared("mixtral", strategy, 2, grad_accum_steps=2, **extra)
    dp, rank = engine.parallel_dims.dp_size, engine.parallel_dims.dp_rank(engine.process_index)
    data = samples(2 * dp * BATCH * STEPS)
    losses, norms, step_losses = [], [], []
    for s in range(STEPS):
        mine = data[(2 * s * dp + 2 * rank) * BATCH:(2 * s * dp + 2 * rank + 2) * BATCH]
        for micro in (mine[:BATCH], mine[BATCH:]):
            with engine.accumulate(model):
                loss = model(**{k: torch.stack([d[k] for d in micro]) for k in data[0]}).loss
                engine.backward(loss)
                step_losses.append(float(engine.reduce(loss.detach(), "mean")))
                if engine.sync_gradients:
                    norms.append(float(engine.clip_grad_norm_(model.parameters(), 1.0)))
                    losses.append(sum(step_losses) / len(step_losses))
                    step_losses = []
                opt.step()
                opt.zero_grad()
    state = engine.get_state_dict(model)
    engine.free_memory()
    return {"losses": losses, "norms": norms, "state": state}


def _four(folder: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {case: _train(*case[:2], ep=case[2]) for case in FOUR}
    out["hybrid"] = _train("mixtral", "zero3", ep=2, shard_group_size=2)  # 2 replicas of 2, ep 2
    out["hybrid", "accumulated"] = _accumulated("zero3", shard_group_size=2)
    out["hybrid", "zero1"] = _train("mixtral", "zero1", ep=2, shard_group_size=2)
    out["accumulated", "zero1"] = _accumulated("zero1")  # ep 2 x data 2: the edp ranks' sum
    out["resume"] = _resume(folder, ("zero1", 2), ("zero3", 4))  # zero1 ep 2 x data 2 -> zero3 ep 4 -> back
    out["empty", "zero1"] = _empty("mixtral", "zero1", 2)  # ep 2 x data 2: DDP holds the experts whole
    out["empty"] = _empty("mixtral", "zero3", 2)  # ep 2 x data 2: the experts' FSDP over the edp ranks
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[Any, Any]], str]:
    folder = str(tmp_path_factory.mktemp("ep"))
    for family in ("mixtral", "qwen"):  # transformers' own save: the experts one by one
        build(family).save_pretrained(f"{folder}/hf_{family}")
    return spawn(_two, 2, folder), folder


def _check(runs: list[dict[Any, Any]], case: Any, ref: dict[str, Any]) -> None:
    for rank, res in enumerate(runs):
        run = res[case]
        assert run["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), \
            f"{case}, rank {rank}: losses {run['losses']}, one process's {ref['losses']}"
        assert run["norms"] == pytest.approx(ref["norms"], abs=LOSS_TOL), \
            f"{case}, rank {rank}: clipped norms {run['norms']}, one process's {ref['norms']}"
    state = runs[0][case]["state"]
    assert state.keys() == ref["state"].keys()
    worst = max((state[k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst <= WEIGHT_TOL, (case, worst)


def _check_zero1_state(runs: list[dict[Any, Any]], case: Any, group: int) -> None:
    """zero1: the optimizer's per-element state (AdamW: 2 per element) split over each group of
    `group` ranks, the split experts' included: together the group's ranks hold every element
    once, and each about 1/group of them (a space's last range is short by its padding)."""
    held = [res[case]["opt_state"] for res in runs]
    numel = runs[0][case]["numel"]
    assert sum(held) == 2 * numel * len(runs) // group, \
        f"{case}: AdamW state elements per rank {held}: {sum(held)} in all, " \
        f"not {2 * numel * len(runs) // group}"
    assert all(h <= 2 * (numel // group + 2) for h in held), (case, held, numel)


@pytest.mark.parametrize("case", TWO, ids=["-".join(c) for c in TWO])
def test_ep2_matches_one_process(two: tuple[list[dict[Any, Any]], str], case: tuple[str, ...]) -> None:
    runs = two[0]
    _check(runs, case, reference(case[0], 2))
    for res in runs:  # each rank holds half of every experts tensor, and only that
        assert res[case]["experts"] and all(local * 2 == full for local, full in res[case]["experts"])
    if case[1] == "zero1":
        _check_zero1_state(runs, case, 2)


def check_aux(runs: list[dict[Any, Any]], case: Any, family: str) -> None:
    """With the router's load-balancing loss on (a statistic of each rank's batch), against one
    plain process computing it per rank's half of each global batch and averaging the losses
    (`reference_per_rank`): without the aux loss the weights land 4e-3 away."""
    _check(runs, case, reference_per_rank(family, 2))


@pytest.mark.parametrize("case", [("aux",), ("aux", "qwen"), ("aux", "tiled")],
                         ids=["mixtral-zero3", "qwen-zero1", "mixtral-zero3-tiled_loss"])
def test_the_load_balancing_loss_is_each_ranks(two: tuple[list[dict[Any, Any]], str],
                                               case: tuple[str, ...]) -> None:
    key = case[0] if len(case) == 1 else case
    check_aux(two[0], key, "qwen" if "qwen" in case else "mixtral")


def _planted_aux() -> dict[Any, Any]:
    return {"aux": _train("mixtral", "zero3", ep=2, aux=True)}  # (as the real test's first case)


def test_a_load_balancing_loss_dropped_is_caught() -> None:
    caught(check_aux, spawn(planted(_planted_aux, "aux_loss_dropped"), 2), "aux", "mixtral",
           must=r"^aux, rank 0: losses \[")


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_an_expert_and_a_rank_that_get_no_tokens(two: tuple[list[dict[Any, Any]], str],
                                                 strategy: str) -> None:
    """A router whose bias sends every token to experts 0 and 1 (rank 0's at ep 2): rank 1 and
    its experts receive no token; the run still equals one process, the idle experts unchanged."""
    key = "skewed" if strategy == "zero3" else ("skewed", "zero1")
    _check(two[0], key, reference("skewed", 2))
    model = build("skewed")  # (the case is what it says: one process routes every token to experts 0-1)
    ids = torch.stack([s["input_ids"] for s in samples(2 * BATCH * STEPS)])
    chosen = torch.topk(model.router(model.embed(ids).reshape(-1, 32)).softmax(-1), 2, dim=-1).indices
    assert set(chosen.unique().tolist()) == {0, 1}, chosen.unique()


def check_generate_in_step(runs: list[dict[Any, Any]]) -> None:
    """Each rank's greedy generation, its own prompts and length, equals one plain process's,
    through the prepared model and through unwrap_model, on every strategy."""
    plain = generate_plain()
    for rank, res in enumerate(runs):
        for strategy, out in res["generate"].items():
            for route in ("prepared", "unwrapped"):
                assert torch.equal(out[route], plain[rank]), (strategy, route, rank, out[route], plain[rank])


def test_generate_stays_in_step_when_experts_are_split(two: tuple[list[dict[Any, Any]], str]) -> None:
    check_generate_in_step(two[0])


def test_tokens_per_expert_count_every_micro_batch(two: tuple[list[dict[Any, Any]], str]) -> None:
    """2 micro-batches per step: each record's tokens per expert are both micro-batches' of both
    ranks (k = 2 per token: 2 x 2 x 2 samples x 16 tokens = 256 per layer), the first step's
    equal to one process's routing of its 8 samples."""
    import json
    from pathlib import Path

    run = Path(two[0][0]["accumulated"]["run"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loads = [r["tokens_per_expert"] for r in records if "tokens_per_expert" in r]
    # (a step's record is written at the next step's boundary; this run ends with free_memory, not
    # end_training, which writes the last one: the spawn's last run, `_metrics`, does that)
    assert len(loads) == STEPS - 1, records
    assert all(sum(layer) == 2 * 2 * 2 * BATCH * SEQ for load in loads for layer in load), loads
    model, seen = build("mixtral"), []
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
    model(**next(iter(DataLoader(samples(2 * 2 * BATCH * STEPS), batch_size=2 * 2 * BATCH))))
    assert loads[0] == [torch.bincount(c.reshape(-1), minlength=4).tolist() for c in seen]


def test_a_checkpoint_resumes_across_expert_parallel_sizes(two: tuple[list[dict[Any, Any]], str]) -> None:
    _check_resumed(two[0][0]["resume"])


def test_the_export_loads_in_a_plain_process(two: tuple[list[dict[Any, Any]], str]) -> None:
    from transformers import MixtralForCausalLM

    run = two[0][0]["resume"]
    model = MixtralForCausalLM.from_pretrained(f"{two[1]}/export")
    state = run["straight"][1]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    same = build("mixtral")
    same.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(input_ids=ids).logits, same(input_ids=ids).logits)


def _check_empty(runs: list[dict[str, Any]], family: str, share: int) -> None:
    """Process 0's gathered weights (every rank's shards) and each rank's share of the experts."""
    whole = build(family).state_dict()  # a normal build with the same seed
    assert runs[0]["empty"].keys() == whole.keys()
    differ = [k for k, v in whole.items() if not torch.equal(runs[0]["empty"][k], v)]
    assert not differ, f"{family}: gathered weights unlike a normal build's: {differ}"
    for run in runs:
        assert run["experts"] and all(local * share == full for local, full in run["experts"])


def test_init_empty_and_from_pretrained_fill_each_ranks_experts(
        two: tuple[list[dict[Any, Any]], str]) -> None:
    """Built under `init_empty()` with ep 2 (Mixtral zero3, Qwen2-MoE zero2): a normal build's
    weights bit for bit, each rank holding half of every experts tensor; `from_pretrained` of the
    export reads it straight into the split, bit for bit."""
    runs = two[0]
    _check_empty([res["empty"] for res in runs], "mixtral", 2)
    _check_empty([res["empty", "qwen"] for res in runs], "qwen", 2)
    exported, loaded = runs[0]["resume"]["straight"][1], runs[0]["empty"]["pretrained"]
    assert exported and loaded.keys() == exported.keys()
    assert all(torch.equal(loaded[k], v) for k, v in exported.items())


def test_from_pretrained_fuses_experts_stored_one_by_one(two: tuple[list[dict[Any, Any]], str]) -> None:
    """transformers' own save_pretrained writes the experts one by one (Mixtral's
    `block_sparse_moe.experts.N.w1/w2/w3`, Qwen2-MoE's `experts.N.gate_proj/up_proj/down_proj`);
    `engine.from_pretrained` reads them fused, each rank its own experts, into the ep 2 split
    (Mixtral zero3, Qwen2-MoE zero1): the saved model's weights bit for bit."""
    runs = two[0]
    _check_empty([res["per_expert", "mixtral"] for res in runs], "mixtral", 2)
    _check_empty([res["per_expert", "qwen"] for res in runs], "qwen", 2)


def test_tokens_per_expert_are_recorded_and_plotted(two: tuple[list[dict[Any, Any]], str]) -> None:
    """Under full activation checkpointing (the run matching one process too): every record
    holds, per MoE layer, the token slots routed to each expert per step over the whole batch,
    counted once although each block routes again in backward (k = 2 per token: 2 x 4 samples x
    16 tokens = 128 per layer); the first step's equal one process's routing of the same batch;
    the report draws them."""
    _check(two[0], "metrics", reference("mixtral", 2))
    import json
    from pathlib import Path

    from shardwise.runtime.report import report

    run = Path(two[0][0]["metrics"]["run"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loads = [r["tokens_per_expert"] for r in records if "tokens_per_expert" in r]
    assert len(loads) == STEPS, records
    assert all(len(load) == 2 and all(sum(layer) == 2 * 2 * BATCH * SEQ for layer in load) for load in loads)
    assert loads[0] == [torch.bincount(c.reshape(-1), minlength=4).tolist() for c in first_routes("mixtral")]
    png, _ = report(run)
    assert png.exists() and png.stat().st_size > 0


@pytest.mark.parametrize("family", ["mixtral", "qwen"])
def test_the_all_to_all_moves_what_the_routing_says(two: tuple[list[dict[Any, Any]], str],
                                                     family: str) -> None:
    """The first step's bytes sent between the 2 ranks, counted at the exchange, against one
    process's routing of the same batch: every token slot whose expert lives on the other rank
    crosses 4 times (the token out and its result back, in forward and again in backward), as
    hidden-size fp32 rows; nothing else crosses."""
    crossing = 0
    for chosen in first_routes(family):
        rank_of_token = torch.arange(len(chosen)) // (BATCH * SEQ)  # rank r holds samples r*BATCH...
        owner = chosen // 2  # 4 experts over 2 ranks: experts 0-1 on rank 0, 2-3 on rank 1
        crossing += int((owner != rank_of_token.unsqueeze(-1)).sum())
    sent = sum(res[family, "zero3"]["sent"][0] for res in two[0])
    assert crossing > 0 and sent == 4 * crossing * 32 * 4, (sent, crossing)


def test_ep4_and_ep2_by_data2_match_one_process(tmp_path: Any) -> None:
    runs = spawn(_four, 4, str(tmp_path))
    for case in FOUR:
        _check(runs, case, reference(case[0], 4))
        if case[1] == "zero1":  # DDP holds the experts whole over the edp ranks (1/ep each) ...
            assert all(local * case[2] == full for res in runs for local, full in res[case]["experts"])
            _check_zero1_state(runs, case, 4)  # ... and their optimizer steps are split over them
            continue
        # 1/ep of the experts each, and below the group sharded over the edp ranks: 1/4 either way
        assert all(local * 4 == full for res in runs for local, full in res[case]["experts"])
    _check_empty([res["empty"] for res in runs], "mixtral", 4)  # init_empty at ep 2 x data 2
    # hybrid sharding: each replica splits the experts over its 2 ranks (half of each tensor)
    _check(runs, "hybrid", reference("mixtral", 4))
    assert all(local * 2 == full for res in runs for local, full in res["hybrid"]["experts"])
    _check(runs, ("hybrid", "accumulated"), reference("mixtral", 8))
    _check(runs, ("hybrid", "zero1"), reference("mixtral", 4))  # zero1: each replica's group of 2
    assert all(local * 2 == full for res in runs for local, full in res["hybrid", "zero1"]["experts"])
    _check_zero1_state(runs, ("hybrid", "zero1"), 2)
    _check(runs, ("accumulated", "zero1"), reference("mixtral", 8))
    _check_resumed(runs[0]["resume"])
    _check_empty([res["empty", "zero1"] for res in runs], "mixtral", 2)


def _check_resumed(run: dict[str, Any]) -> None:
    saved = run["saved"]
    assert saved and all(torch.equal(run["into_plain"][k], v) for k, v in saved.items())
    assert all(torch.equal(run["into_ep"][k], v) for k, v in saved.items())
    assert run["after"][0] == pytest.approx(run["straight"][0], abs=1e-7)
    worst = max((run["after"][1][k] - v).abs().max().item() for k, v in run["straight"][1].items())
    assert worst <= 1e-7, worst


def _eight(folder: str) -> dict[Any, Any]:
    """Hybrid sharding, 2 replicas of 4 (`shard_group_size: 4`), with ep 2 below the group."""
    out: dict[Any, Any] = {}
    out["zero3"] = _train("mixtral", "zero3", ep=2, shard_group_size=4)
    out["zero1"] = _train("qwen", "zero1", ep=2, shard_group_size=4)
    out["accumulated"] = _accumulated("zero2", shard_group_size=4)
    out["resume"] = _resume(folder, ("zero3", 2), ("zero2", 4), shard_group_size=4)
    out["empty"] = _empty("mixtral", "zero3", 2, shard_group_size=4)
    return out


def test_hybrid_sharding_with_ep_below_the_sharding_group(tmp_path: Any) -> None:
    """8 processes, 2 replicas of 4, ep 2 (each replica's experts split over 2 ranks and sharded
    again over the 2 holding the same ones; their FSDP units hybrid over (replicas, holders)):
    Mixtral zero3 and Qwen2-MoE zero1 against one process on the global batch, Mixtral zero2
    with 2 micro-batches per step; each rank a quarter of every experts tensor (zero1: half,
    its optimizer state split over each group of 4); a checkpoint hybrid zero3 ep 2 -> zero2 ep 4
    over all 8 -> back, and an init_empty build, bit for bit."""
    runs = spawn(_eight, 8, str(tmp_path))
    _check(runs, "zero3", reference("mixtral", 8))
    assert all(local * 4 == full for res in runs for local, full in res["zero3"]["experts"])
    _check(runs, "zero1", reference("qwen", 8))
    assert all(local * 2 == full for res in runs for local, full in res["zero1"]["experts"])
    _check_zero1_state(runs, "zero1", 4)
    _check(runs, "accumulated", reference("mixtral", 16))
    _check_resumed(runs[0]["resume"])
    _check_empty([res["empty"] for res in runs], "mixtral", 4)


def _planted_case() -> dict[Any, Any]:
    return {TWO[0]: _train(*TWO[0], ep=2)}  # (the same run as the real test's first case)


def _planted_hybrid() -> dict[Any, Any]:
    return {"hybrid": _train("mixtral", "zero3", ep=2, shard_group_size=2)}  # (as the real test's)


def test_hybrid_replicas_left_unsummed_are_caught() -> None:
    runs = spawn(planted(_planted_hybrid, "experts_replicas_unsummed"), 4)
    caught(_check, runs, "hybrid", reference("mixtral", 4), must=r"^hybrid, rank 0: losses \[")


def _planted_empty() -> dict[str, Any]:
    return _empty("mixtral", "zero3", 2)


def test_an_empty_build_losing_the_experts_init_is_caught() -> None:
    runs = spawn(planted(_planted_empty, "experts_init_dropped"), 2)
    caught(_check_empty, runs, "mixtral", 2,
           must=r"^mixtral: gathered weights unlike a normal build's: \[[^\]]*experts")


def test_experts_gradients_left_summed_are_caught() -> None:
    runs = spawn(planted(_planted_case, "experts_gradient_summed"), 2)
    caught(_check, runs, TWO[0], reference("mixtral", 2),
           must=r"^\('mixtral', 'zero3'\), rank 0: clipped norms \[")  # (its losses pass)


def _planted_zero1() -> dict[Any, Any]:
    return {FOUR[5]: _train(*FOUR[5][:2], ep=FOUR[5][2])}  # zero1 ep 2 x data 2 (as the real test's)


def test_zero1_experts_holders_unsummed_are_caught() -> None:
    runs = spawn(planted(_planted_zero1, "experts_edp_unsummed"), 4)
    caught(_check, runs, FOUR[5], reference("mixtral", 4),
           must=r"^\('mixtral', 'zero1', 2\), rank 0: losses \[")


def test_zero1_experts_optimizer_kept_whole_is_caught() -> None:
    runs = spawn(planted(_planted_zero1, "experts_optimizer_unsplit"), 4)
    _check(runs, FOUR[5], reference("mixtral", 4))  # every number right ...
    caught(_check_zero1_state, runs, FOUR[5], 4,  # ... the state whole on each holder
           must=r"^\('mixtral', 'zero1', 2\): AdamW state elements per rank \[42192, 42192, 42192, 42192\]: "
                r"168768 in all, not 95040")


def test_experts_fused_in_the_wrong_order_are_caught(tmp_path: Any) -> None:
    build("mixtral").save_pretrained(tmp_path / "hf_mixtral")
    runs = spawn(planted(_per_expert, "experts_fused_swapped"), 2, str(tmp_path), "mixtral", "zero3")
    caught(_check_empty, runs, "mixtral", 2,
           must=r"^mixtral: gathered weights unlike a normal build's: \[[^\]]*experts")


def _planted_eight() -> dict[Any, Any]:
    return {"zero3": _train("mixtral", "zero3", ep=2, shard_group_size=4)}  # (as the real test's)


def test_hybrid_experts_units_left_within_the_group_are_caught() -> None:
    runs = spawn(planted(_planted_eight, "experts_hybrid_units_within_group"), 8)
    caught(_check, runs, "zero3", reference("mixtral", 8), must=r"^zero3, rank 0: losses \[")
