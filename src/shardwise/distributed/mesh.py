"""The run's parallel layout: a mesh with named dimensions, the one owner of its process groups.

`ParallelDims` (torchtitan's `distributed/parallel_dims.py` is the model) holds the size of each
dimension; their product is the world size. Today's dimensions are data parallel:
  dp_replicate  groups holding the same shards (DDP's replicas; hybrid sharding's replicas);
  dp_shard      the processes a ZeRO strategy shards parameters, gradients or optimizer state over.
ddp is dp_replicate = W; zero1-3 are dp_shard = W, or with hybrid sharding (shard_group_size G)
dp_replicate = W/G x dp_shard = G, ranks laid out with dp_shard innermost (consecutive ranks
shard together, within a node), and
  tp            tensor parallelism (`tensor_parallel_size`), innermost: the tp consecutive ranks of
                a node split each planned layer (`strategies.tensor_parallel`) and see the same
                batch.
Context and expert parallelism are new entries here. Loaders split data over the data-parallel
ranks (`dp_rank`, `dp_size`: the process rank and count divided by tp).
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
    tp: int = 1
    """tensor parallel: the innermost dimension (consecutive ranks, within a node)"""

    def __post_init__(self) -> None:
        sizes = (self.dp_replicate, self.dp_shard, self.tp)
        if min(sizes) < 1 or self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ValueError(f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} "
                             f"does not make the world of {self.world_size} processes")

    @classmethod
    def for_strategy(cls, *, shards: bool, group: int, world_size: int, device_type: str,
                     tp: int = 1) -> ParallelDims:
        """A strategy's layout: `shards` (zero1-3) over groups of `group` data-parallel ranks, or
        ddp's replicas; `tp` processes of each data-parallel rank split its layers."""
        dp = world_size // tp
        if not shards:
            return cls(dp, 1, world_size, device_type, tp)
        return cls(dp // group, group, world_size, device_type, tp)

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions of more than one process, outermost first (the mesh's dimension names)."""
        sizes = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp))
        return tuple(n for n, size in sizes if size > 1)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """This process's data-parallel rank (which share of the batch it takes): the processes
        of one tp group (consecutive ranks) take the same one."""
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    @functools.cached_property
    def full_mesh(self) -> DeviceMesh:
        """The 3-D mesh ("dp_replicate", "dp_shard", "tp") of a run with tensor parallelism
        (built at first use, collectively)."""
        return init_device_mesh(self.device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The data-parallel sharding mesh (built at first use, collectively): 1-D over the
        data-parallel ranks when one group shards over all, else hybrid's 2-D ("dp_replicate",
        "dp_shard"); with tensor parallelism, those dimensions of `full_mesh`."""
        if self.tp == 1:
            return device_mesh(torch.device(self.device_type), self.dp_shard)
        if self.dp_replicate > 1:
            return self.full_mesh["dp_replicate", "dp_shard"]
        return self.full_mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this process's tensor-parallel group."""
        return self.full_mesh["tp"]

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


