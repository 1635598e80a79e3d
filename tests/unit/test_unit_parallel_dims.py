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
    """get_mesh on rank 0 of a fake world: each view's mesh has the view's size and holds rank
    0's group, in view-rank order; flattened views keep their names."""
    from shardwise.plan.fakes import fake_world

    world = rep * shard * tp
    with fake_world(world):
        dims = ParallelDims(rep, shard, world, "cpu", tp=tp)
        for view in ("batch", "dp", "fsdp", "dp_shard_cp", "loss", "dp_cp", "tp", "dp_shard", "dp_replicate"):
            if dims.view_size(view) == 1 and view not in dims.named_mesh.mesh_dim_names:
                continue
            mesh = dims.get_mesh(view)
            assert mesh.size() == dims.view_size(view), view
            assert mesh.mesh.reshape(-1).tolist() == dims.group_of(view, 0), view
        assert torch.equal(dims.layout.reshape(-1), torch.arange(world))
