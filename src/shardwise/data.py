"""DataLoaders that give each process a disjoint share of every global batch.

A prepared loader's `batch_size` is the per-process batch B; a global batch is W*B samples.
Global batch k is samples [k*W*B, (k+1)*W*B) of the epoch's order, and process r takes the
r-th slice of it, so one process with batch W*B sees exactly the same global batches. The order
is a permutation drawn from (seed, epoch): identical on every process, new each epoch.
A final incomplete global batch of L samples is split into W slices of ceil(L/W), the missing
ones taken again from the start of the epoch; `Engine.gather_for_metrics` drops them again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)


class _EpochOrder:
    """The epoch's sample order: a seeded permutation, the identity, or the user's sampler."""

    def __init__(self, sampler: Sampler[int], seed: int) -> None:
        self.sampler, self.seed = sampler, seed

    def indices(self, epoch: int) -> list[int]:
        if isinstance(self.sampler, RandomSampler) and not self.sampler.replacement:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(len(self.sampler.data_source), generator=g).tolist()
        if isinstance(self.sampler, SequentialSampler):
            return list(range(len(self.sampler.data_source)))
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        return list(self.sampler)


class _RankBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch (see the module docstring)."""

    def __init__(self, order: _EpochOrder, batch_size: int, world: int, rank: int, drop_last: bool) -> None:
        self.order, self.batch_size, self.world, self.rank = order, batch_size, world, rank
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0  # samples of this epoch already consumed (a resumed run skips them)
        self.num_samples = len(order.indices(0))

    def __iter__(self) -> Iterator[list[int]]:
        idx = self.order.indices(self.epoch)
        g = self.batch_size * self.world
        for k in range(self.start, len(idx), g):
            chunk = idx[k : k + g]
            per = self.batch_size
            if len(chunk) < g:
                if self.drop_last:
                    return
                per = math.ceil(len(chunk) / self.world)
                chunk = chunk + [idx[i % len(idx)] for i in range(per * self.world - len(chunk))]
            yield chunk[self.rank * per : (self.rank + 1) * per]

    def __len__(self) -> int:
        g = self.batch_size * self.world
        return self.num_samples // g if self.drop_last else math.ceil(self.num_samples / g)

    def remainder(self) -> int:
        """Real samples in the last global batch (0 when it is full or dropped)."""
        g = self.batch_size * self.world
        return 0 if self.drop_last else self.num_samples % g


class _IterableShard(IterableDataset[Any]):
    """This rank's items of every global batch of an iterable dataset."""

    def __init__(self, dataset: IterableDataset[Any], batch_size: int, world: int, rank: int, drop_last: bool) -> None:
        self.dataset, self.batch_size, self.world, self.rank = dataset, batch_size, world, rank
        self.drop_last = drop_last
        self.last_real = 0  # real samples in the last global batch of the latest pass
        self.start = 0  # items of this pass already consumed (a resumed run skips them)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        g = self.batch_size * self.world
        first: list[Any] = []
        chunk: list[Any] = []
        self.last_real = 0
        for i, item in enumerate(self.dataset):
            if len(first) < g:
                first.append(item)
            if i < self.start:
                continue
            chunk.append(item)
            if len(chunk) == g:
                yield from chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
                chunk = []
        if chunk and not self.drop_last:
            self.last_real = len(chunk)
            per = math.ceil(len(chunk) / self.world)
            chunk = chunk + [first[i % len(first)] for i in range(per * self.world - len(chunk))]
            yield from chunk[self.rank * per : (self.rank + 1) * per]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Tensors anywhere inside dicts, lists, tuples and namedtuples, moved to `device`."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # type: ignore[call-arg]  # keeps BatchEncoding and other dict subclasses
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


class PreparedDataLoader(DataLoader[Any]):
    """A DataLoader over this process's share, with epochs, device placement and lookahead.

    It tells the engine (through `on_batch`) when the batch it yields is the last one, and how
    many real samples the last global batch holds, for accumulation boundaries and metrics.
    """

    def __init__(
        self,
        base: DataLoader[Any],
        *,
        world: int,
        rank: int,
        seed: int,
        device: torch.device,
        on_batch: Callable[[PreparedDataLoader, bool], None],
    ) -> None:
        if base.batch_size is None:
            raise TypeError(
                "prepare() needs a DataLoader built with batch_size=...; a custom batch_sampler "
                "cannot be split into per-process shares"
            )
        self.per_process_batch = base.batch_size
        self.device = device
        self._on_batch = on_batch
        self._epoch: int | None = None
        self._iteration = 0
        self._served = 0  # samples of the current epoch yielded so far (all processes)
        self._resume_at = 0
        kwargs: dict[str, Any] = {
            "num_workers": base.num_workers,
            "collate_fn": base.collate_fn,
            "pin_memory": base.pin_memory,
            "timeout": base.timeout,
            "worker_init_fn": base.worker_init_fn,
            "multiprocessing_context": base.multiprocessing_context,
            "generator": base.generator,
            "persistent_workers": base.persistent_workers,
        }
        if base.num_workers > 0:
            kwargs["prefetch_factor"] = base.prefetch_factor
        dataset = base.dataset
        if isinstance(dataset, IterableDataset):
            if base.num_workers > 0:
                raise ValueError(
                    "prepare() cannot split an IterableDataset read by num_workers>0 workers "
                    "(each worker would repeat the stream); use num_workers=0, or shard the "
                    "stream yourself and skip preparing the loader"
                )
            self._shard: _IterableShard | None = _IterableShard(
                dataset, base.batch_size, world, rank, base.drop_last
            )
            self._batches: _RankBatchSampler | None = None
            super().__init__(self._shard, batch_size=base.batch_size, drop_last=False, **kwargs)
        else:
            order = _EpochOrder(cast(Sampler[int], base.sampler), seed)
            self._batches = _RankBatchSampler(order, base.batch_size, world, rank, base.drop_last)
            self._shard = None
            super().__init__(dataset, batch_sampler=self._batches, **kwargs)
        self.total_batch_size = base.batch_size * world

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (otherwise each new pass over the loader advances the epoch)."""
        self._epoch = epoch

    def remainder(self) -> int:
        """Real samples in the last global batch; 0 when it is full."""
        if self._batches is not None:
            return self._batches.remainder()
        assert self._shard is not None
        return self._shard.last_real

    def state_dict(self) -> dict[str, int | None]:
        """Where the loader stands: its epoch, and the samples of that epoch already served."""
        return {"iteration": self._iteration, "epoch": self._epoch, "samples": self._served}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at that position: the next pass continues the epoch with the next batch.
        The position is in samples, so it holds at another number of processes too."""
        self._iteration = int(state["iteration"])
        self._epoch = None if state["epoch"] is None else int(state["epoch"])
        self._resume_at = int(state["samples"])

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # yields batches, as DataLoader's iterator does
        epoch = self._iteration if self._epoch is None else self._epoch
        start, self._resume_at = self._resume_at, 0
        self._served = start
        if self._batches is not None:
            self._batches.epoch = epoch
            self._batches.start = start
        else:
            assert self._shard is not None
            self._shard.set_epoch(epoch)
            self._shard.start = start
        it = super().__iter__()
        try:
            current = next(it)
        except StopIteration:
            return
        while True:  # look one batch ahead to know which batch is the last
            try:
                upcoming = next(it)
            except StopIteration:
                self._on_batch(self, True)
                self._served += self.total_batch_size
                yield move_to_device(current, self.device)
                break
            self._on_batch(self, False)
            self._served += self.total_batch_size
            yield move_to_device(current, self.device)
            current = upcoming
        self._iteration += 1
        self._served = 0
        if self._epoch is not None:
            self._epoch += 1


def is_dataloader(obj: object) -> bool:
    return isinstance(obj, DataLoader) and not isinstance(obj, PreparedDataLoader)


__all__: Sequence[str] = ["PreparedDataLoader", "is_dataloader", "move_to_device"]
