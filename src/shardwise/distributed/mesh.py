"""The run's parallel layout: a mesh with named dimensions, the one owner of its process groups.

`ParallelDims` (torchtitan's `distributed/parallel_dims.py` is the model) holds the size of each
dimension; their product is the world size. Today's dimensions are data parallel:
  dp_replicate  groups holding the same shards (DDP's replicas; hybrid sharding's replicas);
  dp_shard      the processes a ZeRO strategy shards parameters, gradients or optimizer state over.
ddp is dp_replicate = W; zero1-3 are dp_shard = W, or with hybrid sharding (shard_group_size G)
dp_replicate = W/G x dp_shard = G, ranks laid out with dp_shard innermost (consecutive ranks
shard together, within a node), and
  cp            context parallelism (`strategies.context_parallel`: sequences split along their
                length; its ranks take the same samples), between dp_shard and tp;
  tp            tensor parallelism (`tensor_parallel_size`), innermost: the tp consecutive ranks of
                a node split each planned layer (`strategies.tensor_parallel`) and see the same
                batch;
  ep            expert parallelism, borrowed from dp_shard x cp as torchtitan does.
Ranks are laid out on (dp_replicate, dp_shard, cp, tp) as `init_device_mesh` lays them
(`layout`), and every rank and size is read from that layout by named view (`VIEWS`): `batch`
(the data-parallel ranks: loaders split by it), `loss` (batch x cp), `fsdp` (dp_shard x cp: what
ZeRO shards over), `tp`, `cp`, ... (`coordinates`, `view_rank`, `view_size`, `group_of`);
`get_mesh(name)` is the view's DeviceMesh, each flattened view made once from the one world mesh
(`world_mesh`: every dimension named, built once per process and layout; the sharding `mesh`, the
`tp_mesh` and Accelerate's `named_mesh` are its views). The sizes come from the config's
`parallelism` section (`config.parallelism.resolve_sizes`), never from arithmetic here.
Loaders, `gather`/`reduce`, the metrics' counts and `train_batch_size` ask this object.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .internals import flatten_mesh

DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # the world's layout, outermost first
VIEWS: dict[str, tuple[str, ...]] = {
    "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",), "tp": ("tp",),
    "batch": ("dp_replicate", "dp_shard"),  # different samples: loaders split by it
    "loss": ("dp_replicate", "dp_shard", "cp"),  # the token-weighted loss reduces over it
    "fsdp": ("dp_shard", "cp"),  # what ZeRO shards over
    # Accelerate's names for the same views (`accelerator.torch_device_mesh`)
    "dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the named mesh dimensions of one run (their product: the world size)."""

    dp_replicate: int
    dp_shard: int
    world_size: int
    device_type: str = "cpu"
    tp: int = 1
    """tensor parallel: the innermost dimension (consecutive ranks, within a node)"""
    cp: int = 1
    """context parallel: ranks splitting each sequence, between dp_shard and tp"""
    ep: int = 1
    """expert parallel, borrowed from dp_shard x cp"""

    def __post_init__(self) -> None:
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                 "ep": self.ep}
        bad = [f"{k}={v!r}" for k, v in sizes.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"parallel sizes must be integers >= 1: {', '.join(bad)}")
        if self.dp_replicate * self.dp_shard * self.cp * self.tp != self.world_size:
            raise ValueError(f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                             f"tp={self.tp} does not make the world of {self.world_size} processes")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp_shard x cp = {self.dp_shard * self.cp}: the "
                             "experts are split over the ranks that shard the model")

    # -- ranks and sizes, read from the layout by named view ------------------------------------
    @functools.cached_property
    def layout(self) -> torch.Tensor:
        """World ranks on (dp_replicate, dp_shard, cp, tp), as `init_device_mesh` lays them out."""
        return torch.arange(self.world_size).view(self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in the world of {self.world_size} processes")
        where = (self.layout == rank).nonzero()[0].tolist()
        return dict(zip(DIMS, where, strict=True))

    @staticmethod
    def _dims_of(view: str) -> tuple[str, ...]:
        if view not in VIEWS:
            raise ValueError(f"no mesh view named {view!r}; choose one of: {', '.join(VIEWS)}")
        return VIEWS[view]

    def view_size(self, view: str) -> int:
        """Processes in one group of `view` (e.g. "batch": the data-parallel size)."""
        return math.prod(getattr(self, d) for d in self._dims_of(view))

    def view_rank(self, view: str, rank: int) -> int:
        """`rank`'s index within its group of `view` (row-major over the view's dimensions)."""
        at = self.coordinates(rank)
        index = 0
        for d in self._dims_of(view):
            index = index * getattr(self, d) + at[d]
        return index

    def group_of(self, view: str, rank: int) -> list[int]:
        """The world ranks of `rank`'s group of `view`, in view-rank order."""
        dims = self._dims_of(view)
        at = self.coordinates(rank)
        index = tuple(slice(None) if d in dims else at[d] for d in DIMS)
        return [int(r) for r in self.layout[index].reshape(-1).tolist()]

    def ep_rank(self, rank: int) -> int:
        """`rank`'s index in its expert-parallel group: ep consecutive ranks of its fsdp view."""
        return self.view_rank("fsdp", rank) % self.ep

    def cp_rank(self, rank: int) -> int:
        return self.coordinates(rank)["cp"]

    @property
    def non_data_parallel(self) -> int:
        """Processes that take the same samples (a tp x cp group): a batch counts once for them."""
        return self.cp * self.tp

    def leaders(self) -> list[int]:
        """One process per group that takes the same samples (its tp and cp index 0): whose part
        `gather` keeps, in data-parallel rank order."""
        return [int(r) for r in self.layout[:, :, 0, 0].reshape(-1).tolist()]

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions of more than one process, outermost first (the mesh's dimension names)."""
        return tuple(n for n in DIMS if getattr(self, n) > 1)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches one step sees (the `batch` view)."""
        return self.view_size("batch")

    def dp_rank(self, rank: int) -> int:
        """This process's data-parallel rank (which share of the batch it takes): the processes
        of one tp (and cp) group take the same one."""
        return self.view_rank("batch", rank)

    def tp_rank(self, rank: int) -> int:
        return self.coordinates(rank)["tp"]

    @functools.cached_property
    def world_mesh(self) -> DeviceMesh:
        """The world's one mesh, (dp_replicate, dp_shard, cp, tp) with every dimension named
        (dimensions of one process included), as `layout` lays the ranks out: every other mesh
        of the run is a view of it. Built at first use, collectively, once per process and
        layout (`world_mesh`)."""
        return world_mesh(self.device_type, (self.dp_replicate, self.dp_shard, self.cp, self.tp))

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The data-parallel sharding mesh: `world_mesh`'s "dp_shard" dimension, with hybrid
        sharding its ("dp_replicate", "dp_shard"). Under context parallelism the shard dimension
        is the `fsdp` view (dp_shard x cp, flattened where both are above 1): a context group's
        ranks hold the same parameters, so they shard them too, as torchtitan does."""
        shard = "dp_shard"
        if self.cp > 1:
            shard = "cp" if self.dp_shard == 1 else "fsdp"
            if shard == "fsdp":
                self.get_mesh("fsdp")  # (flattened on the world mesh once: then found by name)
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", shard]
        return self.world_mesh[shard]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this process's tensor-parallel group."""
        return self.world_mesh["tp"]

    def groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """(shard group, replicate group): the processes this one shards with, and those holding
        the same shard in the other groups (None without hybrid sharding)."""
        return mesh_groups(self.mesh)

    @functools.cached_property
    def named_mesh(self) -> DeviceMesh:
        """`world_mesh`'s dimensions of more than one process, by name (Accelerate's
        `torch_device_mesh` shape); "dp_shard" alone where every dimension is of one process."""
        return self.world_mesh[self.names or ("dp_shard",)]

    def get_mesh(self, view: str) -> DeviceMesh:
        """The DeviceMesh of a named view (`VIEWS`): its dimensions of more than one process,
        flattened into one dimension named `view` where there are several (made once, on every
        process together: call it on all of them); a dimension of one process where none is."""
        dims = self._dims_of(view)
        active = [d for d in dims if getattr(self, d) > 1]
        if len(active) > 1:
            return flatten_mesh(self.world_mesh[tuple(active)], view)
        return self.world_mesh[(active or list(dims))[0]]


# see world_mesh; keyed by the default group too, so the planner's fake world (plan/fakes.py),
# which runs inside a live job, never replaces the live job's mesh
_MESHES: dict[tuple[str, tuple[int, ...], int], tuple[dist.ProcessGroup, DeviceMesh]] = {}


def world_mesh(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    """The (dp_replicate, dp_shard, cp, tp) mesh of `shape` over every process, built once per
    default process group and shape: building one makes new process groups on every rank,
    collectively, so every engine (and every strategy a `free_memory` rebuilds) of a process
    reuses it."""
    world = dist.group.WORLD
    key = (device_type, shape, id(world))
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    assert world is not None  # init_device_mesh needs (and made sure of) a default group
    _MESHES[key] = (world, mesh)
    return mesh


def mesh_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group) of a `device_mesh`: the processes this one shards with,
    and those holding the same shard in the other groups (None on a 1-D mesh: no replicas)."""
    if mesh.ndim == 1:
        return mesh.get_group(), None
    return mesh.get_group(1), mesh.get_group(0)


