"""The run's parallel layout: a mesh with named dimensions, the one owner of its process groups.

`ParallelDims` (torchtitan's `distributed/parallel_dims.py` is the model) holds the size of each
dimension; their product is the world size. Today's dimensions are data parallel:
  dp_replicate  groups holding the same shards (DDP's replicas; hybrid sharding's replicas);
  dp_shard      the processes a ZeRO strategy shards parameters, gradients or optimizer state over.
ddp is dp_replicate = W; zero1-3 are dp_shard = W, or with hybrid sharding (shard_group_size G)
dp_replicate = W/G x dp_shard = G, ranks laid out with dp_shard innermost (consecutive ranks
shard together, within a node). Tensor, context and expert parallelism are new entries here
(innermost, so they stay within a node). Loaders split data over the data-parallel ranks
(`dp_rank`, `dp_size`), which equal the process rank and count while every dimension is data
parallel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the named mesh dimensions of one run (their product: the world size)."""

    dp_replicate: int
    dp_shard: int
    world_size: int
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or self.dp_shard < 1 or self.dp_replicate * self.dp_shard != self.world_size:
            raise ValueError(f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} does not make the "
                             f"world of {self.world_size} processes")

    @classmethod
    def for_strategy(cls, *, shards: bool, group: int, world_size: int, device_type: str) -> ParallelDims:
        """A strategy's layout: `shards` (zero1-3) over groups of `group` processes, or ddp's replicas."""
        if not shards:
            return cls(world_size, 1, world_size, device_type)
        return cls(world_size // group, group, world_size, device_type)

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions of more than one process, outermost first (the mesh's dimension names)."""
        return tuple(n for n, size in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))
                     if size > 1)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """This process's data-parallel rank (which share of the batch it takes)."""
        return rank  # every dimension is data parallel (a tp/cp dimension divides here)

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The sharding mesh (built at first use, collectively): 1-D over every process when one
        group shards over all, else hybrid's 2-D ("dp_replicate", "dp_shard")."""
        return device_mesh(torch.device(self.device_type), self.dp_shard)

    def groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """(shard group, replicate group): the processes this one shards with, and those holding
        the same shard in the other groups (None without hybrid sharding)."""
        return mesh_groups(self.mesh)


# see device_mesh; keyed by the default group too, so the planner's fake world (plan/fakes.py),
# which runs inside a live job, never replaces the live job's mesh
_MESHES: dict[tuple[str, int, int], tuple[dist.ProcessGroup, DeviceMesh]] = {}


def device_mesh(device: torch.device, group: int | None = None) -> DeviceMesh:
    """The data-parallel mesh of a run whose sharding groups hold `group` processes (None: all).

    `group` equal to the world size: a 1-D mesh over every process, the sharding dimension.
    Otherwise a 2-D mesh, dims named ("dp_replicate", "dp_shard"), of world/group rows of `group`
    consecutive ranks: ranks 0..group-1 are sharding group 0 (one node, with `shard_group_size:
    node`), and the replicate dimension links the processes at the same position in each group.
    `mesh_groups(mesh)` gives the two process groups. A 2-D mesh is built once per default
    process group and size (building one makes new process groups on every rank, collectively).
    """
    world = dist.get_world_size()
    group = world if group is None else group
    if group == world:
        return init_device_mesh(device.type, (world,))
    if group < 1 or world % group:
        raise ValueError(f"a sharding group of {group} processes does not divide the world of {world}")
    key = (device.type, group, id(dist.group.WORLD))
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    mesh = init_device_mesh(device.type, (world // group, group), mesh_dim_names=("dp_replicate", "dp_shard"))
    world_group = dist.group.WORLD
    assert world_group is not None  # init_device_mesh needs (and made sure of) a default group
    _MESHES[key] = (world_group, mesh)
    return mesh


def mesh_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group) of a `device_mesh`: the processes this one shards with,
    and those holding the same shard in the other groups (None on a 1-D mesh: no replicas)."""
    if mesh.ndim == 1:
        return mesh.get_group(), None
    return mesh.get_group("dp_shard"), mesh.get_group("dp_replicate")


