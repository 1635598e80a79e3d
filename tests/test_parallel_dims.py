"""The named mesh, asked by a user's loop: `engine.parallel_dims` and Accelerate's names for it.

- A loop sizing its DataLoader by `engine.parallel_dims.dp_size` (not `num_processes`) under
  dp 2 x tp 2 (4 processes, given as the `parallelism` section's sizes) trains what one process
  trains on the same global batches; so does a user's own `parallelize(model, dims)` step (torch's
  tensor-parallel styles on the MLPs over `dims.get_mesh("tp")`), the data-parallel step after it.
- `from_pretrained(tp_plan="auto", device_mesh=accelerator.torch_device_mesh)`: the model
  transformers split is kept (never split twice) and trains what one process trains.
- A script in Accelerate's pattern, `Accelerator(parallelism_config=ParallelismConfig(tp_size=2))`
  at 2 processes and, as Accelerate's ND-parallel example (its FSDP plugin says the strategy),
  `ParallelismConfig(dp_shard_size=2, tp_size=2)` at 4, sizing its loader by
  `accelerator.parallelism_config.data_parallel_size` and reading `accelerator.torch_device_mesh`
  (its "tp" dimension and the flattened "dp_cp" view), with `from shardwise import Accelerator`:
  equal to one plain process. (The strategy, zero3: shardwise's keyword at 2 processes, the FSDP
  plugin at 4.)
Tolerances as tests/test_tensor_parallel.py: losses, clipped norms, final weights within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch.utils.data import DataLoader

GLOBAL, STEPS = 4, 4


def _loop(acc: Any, model: Any, opt: Any, loader: Any) -> dict[str, Any]:
    losses, norms = [], []
    for ids in loader:
        loss = W.lm_loss(model, ids)
        acc.backward(loss)
        losses.append(acc.reduce(loss.detach(), "mean").item())
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "state": acc.get_state_dict(model)}


def split_mlps(model: Any, dims: Any) -> None:
    """A user's own model-parallel step (`parallelize`): torch's styles on each Llama MLP over the
    run's tp mesh (attention left whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.mlp, dims.get_mesh("tp"), plan)


def _engine_sized_by_dp(**layout: Any) -> dict[str, Any]:
    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, **layout)
    dims = engine.parallel_dims
    model = W.build("llama")
    opt = W.make_optimizer(model)
    loader = DataLoader(W.Tokens(GLOBAL * STEPS), batch_size=GLOBAL // dims.dp_size, shuffle=True)
    model, opt, loader = engine.prepare(model, opt, loader)
    out = _loop(engine, model, opt, loader)
    out["sizes"] = (dims.dp_size, dims.dp_rank(engine.process_index), dims.tp_rank(engine.process_index),
                    dims.get_mesh("batch").size(), dims.get_mesh("tp").size())
    up = dict(engine.unwrap_model(model).named_parameters())["model.layers.0.mlp.up_proj.weight"]
    out["up_local_rows"] = up.to_local().shape[0]  # 64 rows: / tp 2 / dp_shard 2
    return out


def split_hooks(model: Any) -> dict[str, int]:
    """The forward hooks torch's tensor-parallel styles put on each of the first block's linear
    layers (a style's input and output hooks: a layer split twice carries two sets)."""
    layer = model.model.layers[0]
    named = {"q_proj": layer.self_attn.q_proj, "o_proj": layer.self_attn.o_proj, "up_proj": layer.mlp.up_proj,
             "down_proj": layer.mlp.down_proj}
    return {k: len(m._forward_pre_hooks) + len(m._forward_hooks) for k, m in named.items()}


def check_split_once(run: dict[str, Any]) -> None:
    """The model transformers split arrives as it is: prepare adds no tensor-parallel hook."""
    before, after = run["hooks"]
    assert after == before, \
        f"the split layers carry {after} forward hooks after prepare, {before} before: split twice"


def _accelerate_pattern(sizes: dict[str, int], pretrained: str | None = None, *,
                        plugin: bool = False, forward: bool = True) -> dict[str, Any]:
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from shardwise import Accelerator  # the script's one changed line

    # the strategy: shardwise's keyword, or (`plugin`) as Accelerate's ND-parallel example says it
    said: dict[str, Any] = {"strategy": "zero3"}
    if plugin:
        said = {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT")}
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes), seed=W.SEED, **said)
    assert accelerator.config.sharding.strategy == "zero3"
    torch.manual_seed(W.SEED)
    pc, mesh = accelerator.parallelism_config, accelerator.torch_device_mesh
    if pretrained is None:
        model = W.build("llama")
    else:  # Accelerate's ND-parallel example: transformers splits the model by its own plan on that mesh
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(pretrained, tp_plan="auto", device_mesh=mesh)
    opt = W.make_optimizer(model)
    loader = DataLoader(W.Tokens(GLOBAL * STEPS), batch_size=GLOBAL // pc.data_parallel_size, shuffle=True)
    hooks = split_hooks(model)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    out = {"hooks": (hooks, split_hooks(accelerator.unwrap_model(model)))}
    if forward:
        out.update(_loop(accelerator, model, opt, loader))
    out["sizes"] = (pc.data_parallel_size, pc.non_data_parallel_size, pc.dp_cp_dim_names,
                    mesh["tp"].size(), mesh["dp_cp"].size() if pc.dp_cp_dim_names else 0,
                    accelerator.tensor_parallel_rank,
                    accelerator.data_parallel_shard_rank)
    return out


def _four() -> dict[str, Any]:
    return {"engine": _engine_sized_by_dp(parallelism={"dp_shard": 2, "tp": 2}),
            "user_parallelize": _engine_sized_by_dp(parallelism={"dp_shard": -1, "tp": 2},
                                                    parallelize=split_mlps),
            "accelerate": _accelerate_pattern({"dp_shard_size": 2, "tp_size": 2}, plugin=True)}


def _check(run: dict[str, Any], ref: W.Trained, state: dict[str, torch.Tensor]) -> None:
    assert W.close(run["losses"], ref.losses) < 1e-5, (run["losses"], ref.losses)
    assert W.close(run["norms"], ref.norms) < 1e-5, (run["norms"], ref.norms)
    assert W.max_diff(state, ref.state) < 1e-5


def _two(pretrained: str) -> dict[str, Any]:
    return {"built": _accelerate_pattern({"tp_size": 2}),
            "from_pretrained": _accelerate_pattern({"tp_size": 2}, pretrained)}


def test_tp2_accelerate_pattern_sized_by_its_parallelism_config_matches_one_process(tmp_path: Path) -> None:
    """Also with the model from `from_pretrained(tp_plan="auto", device_mesh=accelerator.torch_device_mesh)`:
    prepare keeps transformers' split (never splits it twice) and trains what one process trains."""
    W.build("llama").save_pretrained(tmp_path / "llama")  # the reference's initial weights
    ranks = spawn(_two, 2, str(tmp_path / "llama"))
    ref = W.reference("llama", world=1, batch=GLOBAL, accum=1, steps=STEPS)
    for rank, run in enumerate(ranks):
        for case in ("built", "from_pretrained"):
            sizes = run[case]["sizes"]
            assert sizes == (1, 2, [], 2, 0, rank, 0), sizes  # no dp_cp view: as Accelerate
            _check(run[case], ref, ranks[0][case]["state"])
        check_split_once(run["from_pretrained"])


def _split_only(pretrained: str) -> dict[str, Any]:
    """The from_pretrained case up to its prepare (a model split twice fails at its first forward)."""
    return _accelerate_pattern({"tp_size": 2}, pretrained, forward=False)


def test_planted_split_twice_is_caught(tmp_path: Path) -> None:
    """`split_twice`: prepare applies the plan again to a model transformers split already; its
    layers carry a second set of hooks before any forward runs."""
    W.build("llama").save_pretrained(tmp_path / "llama")
    runs = spawn(planted(_split_only, "split_twice"), 2, str(tmp_path / "llama"))
    caught(check_split_once, runs[0], must=r"forward hooks after prepare, .* before: split twice")


def _check_layout(ranks: list[dict[str, Any]], cases: tuple[str, ...]) -> None:
    """dp 2 x tp 2 as asked: each rank's sizes and coordinates, the MLP's rows split over tp and
    then sharded over dp_shard, and one process's numbers."""
    ref = W.reference("llama", world=2, batch=GLOBAL // 2, accum=1, steps=STEPS)
    for rank, run in enumerate(ranks):
        for case in cases:
            assert run[case]["sizes"] == (2, rank // 2, rank % 2, 2, 2), run[case]["sizes"]
            assert run[case]["up_local_rows"] == 64 // 2 // 2, \
                f"{case}, rank {rank}: {run[case]['up_local_rows']} of the MLP's 64 rows, " \
                "not 64 / tp 2 / dp_shard 2"
            _check(run[case], ref, ranks[0][case]["state"])


def _section_only() -> dict[str, Any]:
    return {"engine": _engine_sized_by_dp(parallelism={"dp_shard": 2, "tp": 2})}


def test_a_swapped_layout_is_caught() -> None:
    """Planted `parallelism_swapped`: dp_shard and dp_replicate exchanged once resolved (the same
    data-parallel size, ranks and numbers; the model replicated): the layout's check must fail."""
    caught(_check_layout, spawn(planted(_section_only, "parallelism_swapped"), 4), ("engine",),
           must=r"^engine, rank 0: 32 of the MLP's 64 rows, not 64 / tp 2 / dp_shard 2")


def test_dp2_x_tp2_loops_sized_by_the_data_parallel_size_match_one_process() -> None:
    ranks = spawn(_four, 4)
    _check_layout(ranks, ("engine", "user_parallelize"))  # the section's sizes; a user's own step
    ref = W.reference("llama", world=2, batch=GLOBAL // 2, accum=1, steps=STEPS)
    for rank, run in enumerate(ranks):
        sizes = run["accelerate"]["sizes"]
        assert sizes == (2, 2, ["dp_shard"], 2, 2, rank % 2, rank // 2), sizes
        _check(run["accelerate"], ref, ranks[0]["accelerate"]["state"])


# -- a model that arrives split or sharded ----------------------------------------------------------
ARRIVED = {  # case -> the one line's start
    "split over another group": "ConfigError: prepare: this model arrived split over processes [0, 1]",
    "sharded by FSDP already": "ConfigError: prepare: this model is sharded already by FSDP",
}


def _arrived() -> dict[str, str]:
    """A Llama split by torch's tensor-parallel styles over both processes (as transformers'
    tp_plan="auto" splits it) prepared by a run without tensor parallelism, and one sharded by
    fully_shard before prepare: what each prepare raised, as "Type: message"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED)
    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, str] = {}
    for case in ARRIVED:
        model = W.build("llama")
        if case == "split over another group":
            plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            parallelize_module(model.model.layers[0].mlp, mesh, plan)
        else:
            fully_shard(model, mesh=mesh)
        try:
            engine.prepare(model)
            out[case] = "no error"
        except Exception as err:  # noqa: BLE001 - the message is the result
            out[case] = f"{type(err).__name__}: {err}"
    return out


def check_arrived(ranks: list[dict[str, str]]) -> None:
    """Each case refused on both processes, the same one line, starting with its words."""
    for case, start in ARRIVED.items():
        said = [r[case] for r in ranks]
        assert said[0].startswith(start), f"{case}: {said[0]!r} does not start with {start!r}"
        assert "\n" not in said[0] and said[0] == said[1], (case, said)


def test_a_model_split_over_another_group_or_sharded_already_is_refused_in_one_line() -> None:
    check_arrived(spawn(_arrived, 2))


def test_planted_split_group_unchecked_is_caught() -> None:
    """`split_group_unchecked`: a model split over another group than the run's tp group is kept
    as it is (it would train on a layout the run does not have); the refusal check fails."""
    caught(check_arrived, spawn(planted(_arrived, "split_group_unchecked"), 2),
           must=r"^split over another group: .* does not start with "
                r"'ConfigError: prepare: this model arrived split over processes \[0, 1\]'")
