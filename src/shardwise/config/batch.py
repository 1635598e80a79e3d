"""The global batch, resolved against a world: micro-batch x grad_accum_steps x data-parallel
ranks (the processes over tensor and context parallelism: a tp group's processes take one batch)
must make the `train_batch_size` a config states; at another number of processes than the config
was written for, the accumulation is recomputed to keep it (`resolve_grad_accum`)."""

from __future__ import annotations

from .parallelism import ConfigError, data_parallel_size
from .tree import EngineConfig


def _data_parallel(cfg: EngineConfig, world: int) -> tuple[int, str]:
    """The data-parallel ranks of `world` processes (the processes of one tensor-parallel group
    see the same batch), and how to say it."""
    dp = data_parallel_size(cfg.parallelism, world)
    if dp == world:
        return world, f"{world} processes"
    per = f"tensor_parallel_size {world // dp}" if cfg.parallelism.cp == 1 else f"cp x tp {world // dp}"
    return dp, f"{dp} data-parallel ranks ({world} processes / {per})"


def check_train_batch(cfg: EngineConfig, micro_batch: int, world: int) -> None:
    """A `train_batch_size` the config states must equal micro x grad_accum_steps x data-parallel
    ranks (`world` processes over tensor_parallel_size)."""
    total = cfg.training.train_batch_size
    if isinstance(total, int) and not isinstance(total, bool):
        dp, said = _data_parallel(cfg, world)
        actual = micro_batch * cfg.training.grad_accum_steps * dp
        if actual != total:
            raise ConfigError(
                f"train_batch_size={total} but micro_batch_size {micro_batch} x "
                f"grad_accum_steps {cfg.training.grad_accum_steps} x {said} = {actual}"
            )


def resolve_grad_accum(cfg: EngineConfig, micro_batch: int, world: int) -> int:
    """The accumulation steps that keep the global batch (`train_batch_size`, when given) at
    this world size: the config's where it is consistent; recomputed when the run has another
    number of processes than the config was written for (an elastic restart); a config
    inconsistent at its own world size, or a global batch no whole number of micro-batches
    reaches, is refused. A batch counts once per data-parallel rank: the `world` processes over
    tensor_parallel_size (a tp group's processes take the same batch)."""
    total = cfg.training.train_batch_size
    dp, said = _data_parallel(cfg, world)
    if (
        not isinstance(total, int)
        or isinstance(total, bool)
        or micro_batch * cfg.training.grad_accum_steps * dp == total
    ):
        return cfg.training.grad_accum_steps
    written_for = cfg.launch.num_processes * cfg.launch.num_nodes
    if world == written_for:
        check_train_batch(cfg, micro_batch, world)
    if total % (micro_batch * dp):
        raise ConfigError(
            f"train_batch_size={total} cannot be kept at {said} x micro-batch {micro_batch}: "
            f"{total} is not a multiple of {micro_batch * dp}; change the number of processes or the "
            "DataLoader's batch_size"
        )
    return total // (micro_batch * dp)
