"""`ParallelDims` on fake worlds (no process group for the arithmetic; the planner's fake backend
for the meshes): every view's size and every rank's coordinates for (dp_replicate, dp_shard, cp,
tp, ep) layouts up to 8 ranks, read from the one layout `init_device_mesh` makes, and the
refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardwise.distributed.mesh import DIMS, VIEWS, ParallelDims


def _layouts(limit: int = 8) -> list[tuple[int, int, int, int, int]]:
    out = []
    for rep, shard, cp, tp in itertools.product((1, 2, 4, 8), repeat=4):
        world = rep * shard * cp * tp
        if world > limit:
            continue
        out += [(rep, shard, cp, tp, ep) for ep in (1, 2, 4, 8) if (shard * cp) % ep == 0]
    return out


@pytest.mark.parametrize(("rep", "shard", "cp", "tp", "ep"), _layouts())
def test_every_view_and_every_ranks_coordinates(rep: int, shard: int, cp: int, tp: int, ep: int) -> None:
    world = rep * shard * cp * tp
    dims = ParallelDims(rep, shard, world, "cpu", tp=tp, cp=cp, ep=ep)
    sizes = dict(zip(DIMS, (rep, shard, cp, tp), strict=True))
    for rank in range(world):
        # row-major over (dp_replicate, dp_shard, cp, tp): tp innermost (consecutive ranks)
        at = dims.coordinates(rank)
        assert (((at["dp_replicate"] * shard + at["dp_shard"]) * cp + at["cp"]) * tp + at["tp"]) == rank
        assert dims.dp_rank(rank) == at["dp_replicate"] * shard + at["dp_shard"]
        assert dims.tp_rank(rank) == at["tp"] and dims.cp_rank(rank) == at["cp"]
        assert dims.ep_rank(rank) == (at["dp_shard"] * cp + at["cp"]) % ep
    for view, over in VIEWS.items():
        size = 1
        for d in over:
            size *= sizes[d]
        assert dims.view_size(view) == size, view
        groups = {tuple(dims.group_of(view, r)) for r in range(world)}
        assert len(groups) == world // size and all(len(g) == size for g in groups), view  # a partition
        assert sorted(r for g in groups for r in g) == list(range(world)), view
        for rank in range(world):  # its group holds it, at its view rank, and differs only along the view
            group = dims.group_of(view, rank)
            assert group[dims.view_rank(view, rank)] == rank, view
            here = dims.coordinates(rank)
            for other in group:
                assert all(dims.coordinates(other)[d] == here[d] for d in DIMS if d not in over)
    assert dims.dp_size == rep * shard and dims.non_data_parallel == cp * tp
    # one process per group taking the same samples, in data-parallel order
    assert [dims.dp_rank(r) for r in dims.leaders()] == list(range(dims.dp_size))
    assert all(dims.tp_rank(r) == 0 and dims.cp_rank(r) == 0 for r in dims.leaders())


@pytest.mark.parametrize(("args", "kw", "said"), [
    ((3, 2, 8), {}, "dp_replicate=3 x dp_shard=2 x cp=1 x tp=1 does not make the world of 8 processes"),
    ((1, 2, 8), {"tp": 2, "cp": 3}, "does not make the world of 8"),
    ((1, 0, 0), {}, "parallel sizes must be integers >= 1: dp_shard=0"),
    ((1, 2, 4), {"tp": 2, "ep": 4}, "ep=4 does not divide dp_shard x cp = 2"),
    ((1, 4, 4), {"ep": True}, "parallel sizes must be integers >= 1: ep=True"),
])
def test_layouts_that_cannot_be_are_refused_in_one_line(args: tuple[int, ...], kw: dict[str, object],
                                                        said: str) -> None:
    with pytest.raises(ValueError) as err:
        ParallelDims(*args, **kw)  # type: ignore[arg-type]
    assert said in str(err.value) and "\n" not in str(err.value)


def test_unknown_views_and_ranks_are_refused() -> None:
    dims = ParallelDims(1, 2, 4, tp=2)
    with pytest.raises(ValueError, match="no mesh view named 'dpp'; choose one of: dp_replicate"):
        dims.view_size("dpp")
    with pytest.raises(ValueError, match="rank 4 is not in the world of 4"):
        dims.coordinates(4)


@pytest.mark.parametrize(("rep", "shard", "tp"), [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2),
                                                  (1, 1, 4), (2, 2, 2)])
def test_meshes_of_each_view_on_a_fake_world(rep: int, shard: int, tp: int) -> None:
    """get_mesh on rank 0 of a fake world: each view's mesh (a view of the one world mesh) has the
    view's size and holds rank 0's group, in view-rank order; flattened views keep their names."""
    from shardwise.plan.fakes import fake_world

    world = rep * shard * tp
    with fake_world(world):
        dims = ParallelDims(rep, shard, world, "cpu", tp=tp)
        for view in ("batch", "dp", "fsdp", "dp_shard_cp", "loss", "dp_cp", "tp", "dp_shard", "dp_replicate"):
            mesh = dims.get_mesh(view)  # (a view of one process too: its dimension of the world mesh)
            assert mesh.size() == dims.view_size(view), view
            assert mesh.mesh.reshape(-1).tolist() == dims.group_of(view, 0), view
        assert torch.equal(dims.layout.reshape(-1), torch.arange(world))


# -- the `parallelism` section: sizes resolved from it (and from the flat keys), and its refusals --
def _layout(world: int, local: int | None = None, **config: object) -> ParallelDims:
    from shardwise.config import EngineConfig
    from shardwise.distributed.world import DistInfo
    from shardwise.strategies.base import Strategy, layout

    cfg = EngineConfig.of(**config)  # type: ignore[arg-type]
    info = DistInfo(rank=0, world_size=world, local_rank=0, local_world_size=local or world,
                    device=torch.device("cpu"))
    strategy = cfg.sharding.strategy
    shards = strategy != "ddp" and not (strategy == "zero1" and cfg.parallelism.tp > 1)
    return layout(cfg, info, shards=shards, supported=Strategy.supported_dims)


@pytest.mark.parametrize(("config", "sizes"), [
    ({"strategy": "zero3"}, (1, 8, 1, 1)),
    ({"strategy": "zero3", "parallelism": {"tp": 2}}, (1, 4, 1, 2)),
    ({"strategy": "zero3", "tensor_parallel_size": 2, "parallelism": {"tp": 2}}, (1, 4, 1, 2)),  # agree
    ({"strategy": "zero3", "parallelism": {"dp_replicate": 2, "tp": 2}}, (2, 2, 1, 2)),
    ({"strategy": "zero3", "parallelism": {"dp_replicate": -1, "dp_shard": 2}}, (4, 2, 1, 1)),
    ({"strategy": "zero2", "shard_group_size": 4, "parallelism": {"dp_shard": 2, "tp": 2}}, (2, 2, 1, 2)),
    ({"strategy": "zero3", "shard_group_size": 4, "tensor_parallel_size": 2}, (2, 2, 1, 2)),  # flat keys
    ({"strategy": "ddp", "parallelism": {"dp_replicate": -1}}, (8, 1, 1, 1)),
    ({"strategy": "ddp", "tensor_parallel_size": 2}, (4, 1, 1, 2)),
])
def test_the_section_and_the_flat_keys_resolve_to_one_layout(config: dict, sizes: tuple) -> None:
    dims = _layout(8, **config)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == sizes
    assert dims.dp_size == sizes[0] * sizes[1]


@pytest.mark.parametrize(("config", "message"), [
    ({"parallelism": {"tp": 2}, "tensor_parallel_size": 4},
     "parallelism.tp=2 and tensor_parallel_size=4 disagree"),
    ({"parallelism": {"dp_shard": 2}}, "parallelism.dp_shard=2 with strategy: ddp, which shards nothing"),
    ({"parallelism": {"dp_shard": -1, "dp_replicate": -1}}, "both ask for the rest"),
    ({"parallelism": {"cp": 0}}, "parallelism.cp=0 must be an integer >= 1"),
    ({"parallelism": {"tp": -1}}, "parallelism.tp=-1 must be an integer >= 1"),
    ({"parallelism": {"pp": 2}}, "unknown key 'parallelism.pp'"),
])
def test_bad_sizes_are_refused_at_construction(config: dict, message: str) -> None:
    from shardwise.config import EngineConfig

    with pytest.raises((ValueError, TypeError), match=message.replace(".", r"\.")):
        EngineConfig.of(**config)


@pytest.mark.parametrize(("world", "config", "message"), [
    (8, {"strategy": "zero3", "parallelism": {"dp_shard": 3}},
     "parallelism.dp_shard=3 does not divide the 8"),
    (8, {"strategy": "zero3", "parallelism": {"dp_replicate": 2, "dp_shard": 2, "tp": 4}},
     "dp_replicate=2 x dp_shard=2 x cp=1 x tp=4 = 16 is not the 8 processes"),
    (8, {"strategy": "zero3", "shard_group_size": 4, "parallelism": {"dp_shard": 2}},
     "shard_group_size (4 processes: 4 data-parallel ranks) and parallelism.dp_shard=2 disagree"),
    (8, {"strategy": "zero3", "parallelism": {"cp": 3}}, "cp=3 x tp=1 does not divide the 8 processes"),
    (8, {"strategy": "zero3", "parallelism": {"ep": 2, "tp": 2}},
     "expert_parallel_size=2: this version splits experts without context or tensor parallelism"),
    (8, {"strategy": "zero3", "parallelism": {"ep": 3}}, "ep=3 does not divide dp_shard x cp = 8"),
    (6, {"strategy": "zero3", "parallelism": {"tp": 4}}, "tensor_parallel_size=4 does not divide the 6"),
    # the strategy is the reason, not the dp_shard of 1 that ddp leaves the experts
    (2, {"strategy": "ddp", "expert_parallel_size": 2},
     "expert_parallel_size=2 needs strategy zero1, zero2 or zero3 (got ddp)"),
    (2, {"strategy": "ddp", "parallelism": {"ep": 2}}, "needs strategy zero1, zero2 or zero3 (got ddp)"),
    (4, {"strategy": "zero3", "parallelism": {"ep": 2, "dp_replicate": 4}},
     "ep=2 does not divide dp_shard x cp = 1"),
])
def test_sizes_that_do_not_fit_the_world_are_refused_in_one_line(world: int, config: dict,
                                                                 message: str) -> None:
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        _layout(world, **config)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("world", "config", "message"), [
    (4, {"context_parallel_size": 2, "shard_group_size": 1},
     "shard_group_size=1 (1 processes) does not hold whole context-parallel groups of 2 processes: choose a "
     "multiple of context_parallel_size=2 (a group of G processes is G / 2 data-parallel ranks)"),
    (4, {"tensor_parallel_size": 2, "shard_group_size": 1},
     "shard_group_size=1 (1 processes) does not hold whole tensor-parallel groups of 2 processes: choose a "
     "multiple of tensor_parallel_size=2 (a group of G processes is G / 2 data-parallel ranks)"),
    (8, {"context_parallel_size": 2, "tensor_parallel_size": 2, "shard_group_size": 2},
     "shard_group_size=2 (2 processes) does not hold whole context x tensor-parallel groups of 4 processes: "
     "choose a multiple of context_parallel_size=2 x tensor_parallel_size=2 = 4 (a group of G processes is "
     "G / 4 data-parallel ranks)"),
])
def test_a_sharding_group_that_cuts_a_rank_names_the_dimensions_in_use(world: int, config: dict,
                                                                        message: str) -> None:
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        _layout(world, strategy="zero3", **config)
    assert str(refused.value) == message


def test_deepspeed_declares_its_dimensions_and_refuses_the_rest() -> None:
    from shardwise.config import ConfigError, EngineConfig
    from shardwise.distributed.world import DistInfo
    from shardwise.strategies.base import layout
    from shardwise.strategies.deepspeed.strategy import DeepSpeedStrategy

    assert DeepSpeedStrategy.supported_dims == {"dp_shard", "tp"} and DeepSpeedStrategy.own_steps == {"tp"}
    cfg = EngineConfig.of(strategy="zero2", backend="deepspeed", parallelism={"dp_replicate": 2})
    info = DistInfo(rank=0, world_size=4, local_rank=0, local_world_size=4, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="parallelism dp_replicate=2: backend deepspeed does not split "
                                          "along it \\(it splits dp_shard, tp\\)"):
        layout(cfg, info, shards=True, supported=DeepSpeedStrategy.supported_dims)
    with pytest.raises(ConfigError, match="parallelize with backend: deepspeed"):
        EngineConfig.of(strategy="zero2", backend="deepspeed", parallelize="mod:fn")


def test_a_user_parallelize_by_name_is_imported_or_refused() -> None:
    from shardwise.config import ConfigError, EngineConfig
    from shardwise.config.files import to_dict
    from shardwise.strategies.steps import resolve_parallelize

    assert resolve_parallelize("os.path:join") is __import__("os").path.join
    with pytest.raises(ConfigError, match="parallelize='nowhere_at_all:fn': cannot import 'fn'"):
        resolve_parallelize("nowhere_at_all:fn")
    with pytest.raises(ConfigError, match="must be a function parallelize\\(model, dims\\)"):
        EngineConfig.of(parallelize="no_colon")
    written = to_dict(EngineConfig.of(parallelize=_layout))
    assert written["parallelism"]["parallelize"] == f"{__name__}:_layout"
