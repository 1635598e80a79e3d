"""DataLoaders that give each process a disjoint share of every global batch.

A prepared loader's `batch_size` is the per-process batch B; a global batch is W*B samples.
Global batch k is samples [k*W*B, (k+1)*W*B) of the epoch's order, and process r takes the
r-th slice of it, so one process with batch W*B sees exactly the same global batches. The order
is identical on every process and new each epoch; `_EpochOrder` says where it comes from (the
user's sampler and generator are honoured).
A final incomplete global batch of L samples is split into W slices of ceil(L/W) (`Engine`), or
into full batches of B (`Accelerator`, as Accelerate's even_batches), the missing ones taken
again from the start of the epoch; `Engine.gather_for_metrics` drops them again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from ..checkpoint.sharded import kept_rng
from ..distributed.world import host_device

_END = object()


def _draw_seed() -> int:
    """The seed torch's RandomSampler draws from the global generator for a pass."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _sync_generator(g: torch.Generator, world: int) -> None:
    """Process 0's generator state on every process (as Accelerate's synchronized generator)."""
    if world > 1 and dist.is_available() and dist.is_initialized():
        state = g.get_state().to(host_device(None))  # (a pure-NCCL group: on the device)
        dist.broadcast(state, src=0)
        g.set_state(state.cpu())


class _EpochOrder:
    """The sample order of each pass, identical on every process. Which rule applies:

    seeded     a RandomSampler without a generator of its own, and the engine was given a seed:
               the permutation torch.randperm(n, seed + epoch).
    generator  a sampler with a `generator` (the DataLoader's `generator=`, or one made at
               prepare on several processes from one draw of the global torch generator, as
               Accelerate does): process 0's generator state is sent to all at each pass, then
               the user's sampler is iterated as is, so the order is the user's.
    drawn      one process, RandomSampler without a generator: what torch does, a seed drawn
               from the global torch generator at each pass.
    as is      any other sampler (SequentialSampler, the user's own): iterated as is, after
               `set_epoch(epoch)` where it has one.
    What decided a pass's order (generator state or drawn seed) is kept in the loader's state,
    so a mid-epoch resume continues the same order without drawing again. The order is drawn
    lazily, as a DataLoader draws it: torch's RandomSampler draws one more permutation only when
    iterated to its end, so a pass left with `break` leaves the generator where Accelerate does.
    """

    def __init__(self, sampler: Sampler[int], seed: int | None, world: int, *,
                 seedable: bool = False) -> None:
        self.sampler, self.seed, self.world = sampler, seed, world
        self.source: Any = None  # what decided the current pass's order (checkpointed)
        self.resume: Any = None  # that, from a checkpoint, for the next pass
        generator = getattr(sampler, "generator", "absent")
        if seedable and isinstance(sampler, RandomSampler) and not sampler.replacement:
            # Accelerate's use_seedable_sampler: randperm(n, data_seed + epoch) whatever the generator
            self.seed = seed if seed is not None else torch.initial_seed()
            self.mode = "seeded"
        elif (isinstance(sampler, RandomSampler) and generator is None and seed is not None
              and not sampler.replacement):
            self.mode = "seeded"
        elif isinstance(generator, torch.Generator):
            self.mode = "generator"
        elif isinstance(sampler, RandomSampler) and generator is None and world > 1:
            sampler.generator = torch.Generator()
            sampler.generator.manual_seed(_draw_seed())
            self.mode = "generator"
        elif isinstance(sampler, RandomSampler) and generator is None:
            self.mode = "drawn"
        else:
            self.mode = "as is"

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]  # every sampler a DataLoader takes has one

    def stream(self, epoch: int) -> Iterator[int]:
        resume, self.resume = self.resume, None
        if self.mode == "seeded":
            assert self.seed is not None
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self.source = None
            n = len(cast(RandomSampler, self.sampler).data_source)
            return iter(torch.randperm(n, generator=g).tolist())
        if self.mode == "generator":
            g = cast(torch.Generator, getattr(self.sampler, "generator"))  # noqa: B009
            if resume is not None:
                g.set_state(resume)
            else:
                _sync_generator(g, self.world)
            self.source = g.get_state()
            return iter(self.sampler)
        if self.mode == "drawn":
            sampler = cast(RandomSampler, self.sampler)
            self.source = seed = int(resume) if resume is not None else _draw_seed()
            sampler.generator = torch.Generator()
            sampler.generator.manual_seed(seed)
            try:
                it = iter(sampler)
                first = next(it, _END)  # RandomSampler takes its generator at its first draw
            finally:
                sampler.generator = None
            return iter(()) if first is _END else itertools.chain([cast(int, first)], it)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        return iter(self.sampler)


class _RankBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch (see the module docstring)."""

    def __init__(self, order: _EpochOrder, batch_size: int, world: int, rank: int, drop_last: bool,
                 *, tail: str = "split") -> None:
        self.order, self.batch_size, self.world, self.rank = order, batch_size, world, rank
        self.drop_last = drop_last
        self.tail = tail  # the last incomplete global batch: "split", "full" or "uneven"
        self.epoch = 0
        self.start = 0  # samples of this epoch already consumed (a resumed run skips them)
        self.num_samples = len(order)

    def __iter__(self) -> Iterator[list[int]]:
        stream = self.order.stream(self.epoch)
        g = self.batch_size * self.world
        first = list(itertools.islice(stream, g))  # the epoch's first samples: a "full" tail repeats them
        rest = itertools.chain(first, stream)
        next(itertools.islice(rest, self.start, self.start), None)  # a resumed pass: skip the served samples
        while chunk := list(itertools.islice(rest, g)):
            per = self.batch_size
            if len(chunk) < g:
                if self.drop_last:
                    return
                if self.tail == "uneven":  # Accelerate's even_batches=False: what is there
                    mine = chunk[self.rank * per : (self.rank + 1) * per]
                    if mine:
                        yield mine
                    return
                if self.tail == "split":
                    per = math.ceil(len(chunk) / self.world)
                # "full": every process a full batch, the missing samples taken again from the
                # start of the epoch (Accelerate's even_batches=True)
                pad = per * self.world - len(chunk)
                chunk = chunk + [first[i % len(first)] for i in range(pad)]
            yield chunk[self.rank * per : (self.rank + 1) * per]

    def __len__(self) -> int:
        g = self.batch_size * self.world
        if self.drop_last:
            return self.num_samples // g
        if self.tail == "uneven" and self.num_samples % g:
            full, rest = divmod(self.num_samples, g)
            return full + (1 if rest > self.rank * self.batch_size else 0)
        return math.ceil(self.num_samples / g)

    def remainder(self) -> int:
        """Real samples in the last global batch (0 when it is full or dropped)."""
        g = self.batch_size * self.world
        return 0 if self.drop_last else self.num_samples % g


class _IterableShard(IterableDataset[Any]):
    """This rank's items of every global batch of an iterable dataset."""

    def __init__(self, dataset: IterableDataset[Any], batch_size: int, world: int, rank: int,
                 drop_last: bool) -> None:
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
            # keeps BatchEncoding and other dict subclasses
            return type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def first_samples(loader: Any, most: int = 2) -> Any | None:
    """A batch of `loader`'s first `most` samples, collated as its batches are, for a trial that
    must not change the run: its sampler is not touched and the random generators (python,
    numpy, torch) are put back. None for an iterable dataset (reading it may consume it)."""
    dataset: Any = getattr(loader, "dataset", None)
    readable = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if isinstance(dataset, IterableDataset) or not readable:
        return None
    collate = getattr(loader, "collate_fn", None)
    count = min(most, len(dataset), getattr(loader, "batch_size", None) or most)
    if collate is None or count == 0:
        return None
    with kept_rng():
        try:
            return collate([dataset[i] for i in range(count)])
        except Exception:  # noqa: BLE001 - not readable by position: the trial is skipped
            return None


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
        seed: int | None,
        device: torch.device,
        on_batch: Callable[[PreparedDataLoader, bool, Any], None],
        tail: str = "split",
        split_batches: bool = False,
        seedable: bool = False,
        on_end: Callable[[PreparedDataLoader], None] | None = None,
        resume_draws: bool = False,
        on_pass: Callable[[], None] | None = None,
    ) -> None:
        if base.batch_size is None:
            raise TypeError(
                "prepare() needs a DataLoader built with batch_size=...; a custom batch_sampler "
                "cannot be split into per-process shares"
            )
        batch_size = base.batch_size
        if split_batches:  # Accelerate's split_batches: the loader's batch is the global one
            if batch_size % world:
                raise ValueError(f"split_batches: the DataLoader's batch_size={batch_size} must be a "
                                 f"multiple of the {world} processes")
            batch_size //= world
        self.per_process_batch = batch_size
        self._tail = tail  # iterable datasets; a sampled one's tail is its batch sampler's
        self.device = device
        self._on_batch = on_batch
        self._on_end = on_end  # called when a loop over the loader ran to its end
        self._on_pass = on_pass  # called as a pass starts, before its order is agreed (a collective)
        self.resume_draws = resume_draws  # a resumed pass draws its iterator seed, as Accelerate's does
        self._epoch: int | None = None
        self._iteration = 0
        self._served = 0  # samples of the current epoch yielded so far (all processes)
        self._resume_at = 0
        self._detached = False  # the next pass leaves the epoch as it was (skip_first_batches)
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
                dataset, batch_size, world, rank, base.drop_last
            )
            self._batches: _RankBatchSampler | None = None
            super().__init__(self._shard, batch_size=batch_size, drop_last=False, **kwargs)
        else:
            order = _EpochOrder(cast(Sampler[int], base.sampler), seed, world, seedable=seedable)
            self._batches = _RankBatchSampler(order, batch_size, world, rank, base.drop_last, tail=tail)
            self._shard = None
            super().__init__(dataset, batch_sampler=self._batches, **kwargs)
        self.total_batch_size = batch_size * world

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (otherwise each new pass over the loader advances the epoch)."""
        self._epoch = epoch

    @property
    def epoch(self) -> int | None:
        """The epoch `set_epoch` gave (advanced by each finished pass); None if never set."""
        return self._epoch

    @property
    def iteration(self) -> int:
        """Passes over the loader finished so far."""
        return self._iteration

    @property
    def served(self) -> int:
        """Samples of the current pass yielded so far, over all processes (0 between passes)."""
        return self._served

    @property
    def tail(self) -> str:
        """How the last incomplete global batch is split: "split", "full" or "uneven"."""
        return self._batches.tail if self._batches is not None else self._tail

    def set_tail(self, tail: str) -> None:
        """Change how the last incomplete global batch is split, from the next pass on
        (Accelerate's `even_batches`); an iterable dataset's loader keeps its own."""
        if self._batches is not None:
            self._batches.tail = tail

    def forget_position(self, iteration: int, epoch: int | None) -> None:
        """Stand at the start of a pass again, as pass `iteration` of `epoch` (a restored
        checkpoint's place within its epoch and its order are dropped)."""
        self._resume_at, self._iteration, self._epoch = 0, iteration, epoch
        if self._batches is not None:
            self._batches.order.resume = None

    def skip_first_batches(self, num_batches: int, *, detached: bool = False) -> None:
        """The next pass starts after its first `num_batches` batches (of this process).
        `detached`: that pass leaves the loader's epoch as it was (Accelerate's skip_first_batches
        iterates a new loader, so the original's epoch does not advance)."""
        self._resume_at = num_batches * self.total_batch_size
        self._detached = detached

    def remainder(self) -> int:
        """Real samples in the last global batch; 0 when it is full."""
        if self._batches is not None:
            return self._batches.remainder()
        assert self._shard is not None
        return self._shard.last_real

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: its epoch, the samples of that epoch already served, and
        what decided the epoch's order (a generator state or a drawn seed; see _EpochOrder)."""
        order = self._batches.order.source if self._batches is not None and self._served else None
        return {"iteration": self._iteration, "epoch": self._epoch, "samples": self._served, "order": order}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at that position: the next pass continues the epoch with the next batch.
        The position is in samples, so it holds at another number of processes too."""
        self._iteration = int(state["iteration"])
        self._epoch = None if state["epoch"] is None else int(state["epoch"])
        self._resume_at = int(state["samples"])
        if self._batches is not None:
            self._batches.order.resume = state.get("order")

    # yields batches, as DataLoader's iterator does
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._on_pass is not None:
            self._on_pass()
        epoch = self._iteration if self._epoch is None else self._epoch
        start, self._resume_at = self._resume_at, 0
        detached, self._detached = self._detached, False
        before = (self._iteration, self._epoch)
        self._served = start
        if self._batches is not None:
            self._batches.epoch = epoch
            self._batches.start = start
        else:
            assert self._shard is not None
            self._shard.set_epoch(epoch)
            self._shard.start = start
        if start and not self.resume_draws:
            # a resumed pass: the uninterrupted run drew the iterator's base seed from the global
            # generator at the epoch's start, before the checkpoint's RNG state; drawing it again
            # here would shift every later random draw (dropout) of the resumed run
            with torch.random.fork_rng(devices=[]):
                it = super().__iter__()
        else:
            it = super().__iter__()
        current = next(it, _END)
        if current is _END:
            if self._on_end is not None:
                self._on_end(self)
            return
        while True:  # look one batch ahead to know which batch is the last
            try:
                upcoming = next(it)
            except StopIteration:
                self._on_batch(self, True, current)
                self._served += self.total_batch_size
                yield move_to_device(current, self.device)
                break
            self._on_batch(self, False, current)
            self._served += self.total_batch_size
            yield move_to_device(current, self.device)
            current = upcoming
        self._iteration += 1
        self._served = 0
        if self._epoch is not None:
            self._epoch += 1
        if detached:
            self._iteration, self._epoch = before
        if self._on_end is not None:
            self._on_end(self)


def check_unsplit(loader: Any) -> None:
    """Refuse in one line a DataLoader split over the ranks already (a DistributedSampler of more
    than one replica): prepare splits it over the data-parallel ranks, and a second split would
    train each rank on a fraction of its share, silently."""
    from torch.utils.data import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas > 1:
        raise ValueError(f"prepare: this DataLoader's sampler is a DistributedSampler over "
                         f"{sampler.num_replicas} replicas, and prepare splits the data over the "
                         "data-parallel ranks itself (it would be split twice); pass a DataLoader over the "
                         "whole dataset "
                         "(shuffle=True in place of the sampler)")


def is_dataloader(obj: object) -> bool:
    return isinstance(obj, DataLoader) and not isinstance(obj, PreparedDataLoader)


__all__: Sequence[str] = ["PreparedDataLoader", "is_dataloader", "move_to_device"]
