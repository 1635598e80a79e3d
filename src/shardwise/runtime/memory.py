"""Per-rank tensor memory, counted by storage so shared and aliased tensors count once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from ..distributed.internals import fsdp_params, local_tensor, storage_ref


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes of tensor storage this process holds, by role, and how much of it is on the host."""

    params: int
    grads: int
    optimizer: int
    host: int
    staging: int = 0  # host copies of a checkpoint being written (checkpoint_async); 0 when none is

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.staging

    def __str__(self) -> str:
        mib = 2**20
        staging = f", checkpoint staging {self.staging / mib:.2f} MiB" if self.staging else ""
        return (
            f"params {self.params / mib:.2f} MiB, grads {self.grads / mib:.2f} MiB, "
            f"optimizer {self.optimizer / mib:.2f} MiB{staging}; {self.host / mib:.2f} MiB of it on the host"
        )


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    local = local_tensor(t)
    return local.untyped_storage()


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.host = 0

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            s = _storage(t)
            key = (str(s.device), s.data_ptr())
            if s.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += s.nbytes()
            if s.device.type == "cpu":
                self.host += s.nbytes()
        return total


def tensor_memory(models: Iterable[nn.Module], optimizer_tensors: Iterable[torch.Tensor], *,
                  staging: int = 0) -> MemoryReport:
    """Count parameters, gradients and optimizer tensors (each storage once) on this process.

    FSDP2 keeps each shard in a padded storage: the count includes that padding, as the
    allocator does. Host bytes are reported as well; on a CPU-only machine everything is host.
    Parameters count as held: a shard, and beside it the whole parameter while it is gathered
    (mid-forward, or kept for a backward), never the configured shard alone. Being counted from
    the local tensors, hybrid sharding shows as it is: shards and optimizer state of 1/G
    (`shard_group_size` G), not 1/W. `staging`: the host bytes of a checkpoint being written in
    the background (`checkpoint_async.staging_bytes`), counted on the host.
    """
    models = list(models)
    c = _Counter()
    params = list({id(p): p for m in models for p in _held_params(m)}.values())
    n_params = c.add(params)
    n_grads = c.add(p.grad for p in params)
    n_opt = c.add(optimizer_tensors)
    return MemoryReport(params=n_params, grads=n_grads, optimizer=n_opt, host=c.host + staging,
                        staging=staging)


def _held_params(model: nn.Module) -> Iterator[torch.Tensor]:
    """The parameter tensors `model` holds on this process (empty ones are skipped by the count).

    The module's registered parameters, and: DeepSpeed ZeRO-3's partition (`ds_tensor`) beside
    the parameter, which is empty unless gathered; FSDP2's shard (a DTensor) and its gathered
    parameter, of which the module registers one at a time.
    """
    for p in model.parameters():
        yield p
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            yield part
    for m in model.modules():
        for sharded, gathered in fsdp_params(m):  # FSDP2's: no public view of the gathered one
            yield sharded
            if gathered is not None:  # set once first gathered
                yield gathered


class SavedActivations:
    """The bytes autograd saves for backward while the block runs: the activations a step holds
    at its peak (the weights a layer saves included), each storage counted once (a DTensor's
    local one), keyed by the storage itself, not its address (FSDP2 frees a block's gathered
    weights after its forward and the next block's may reuse the address).

        with shardwise.SavedActivations() as saved:
            loss = model(**batch).loss
        print(saved.total)          # bytes
    """

    def __init__(self) -> None:
        self.sizes: dict[Any, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        self.sizes[storage_ref(local)] = local.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
