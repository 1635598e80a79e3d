"""The step state and the token count, in one process (`shardwise.engine.step`, `.items`)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardwise.distributed.world import DistInfo
from shardwise.engine.items import ItemCount, per_item
from shardwise.engine.step import StepState

ONE = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def test_an_accumulation_ends_every_grad_accum_steps_micro_steps() -> None:
    state = StepState(grad_accum_steps=3)
    syncs = []
    for _ in range(7):
        state.begin_micro_step(loader_at_end=False)
        syncs.append(state.sync)
    assert syncs == [False, False, True, False, False, True, False]


def test_the_loaders_last_batch_ends_an_accumulation_and_restarts_the_count() -> None:
    state = StepState(grad_accum_steps=4)
    state.begin_micro_step(loader_at_end=False)
    state.begin_micro_step(loader_at_end=True)  # a short window at the end of an epoch
    assert state.sync and state.micro_step == 0
    syncs = []
    for _ in range(4):
        state.begin_micro_step(loader_at_end=False)
        syncs.append(state.sync)
    assert syncs == [False, False, False, True]


def test_two_optimizers_on_one_boundary_count_one_step() -> None:
    state = StepState(grad_accum_steps=1)
    state.begin_micro_step(loader_at_end=False)
    assert state.record_step(1) is True
    assert state.record_step(2) is False
    assert state.optimizer_steps == 1


def test_the_same_optimizer_again_without_accumulate_is_a_new_step() -> None:
    state = StepState(grad_accum_steps=1)
    assert state.record_step(1) and state.record_step(1)
    assert state.optimizer_steps == 2


def test_a_new_micro_step_forgets_the_scripts_clipping() -> None:
    state = StepState(grad_accum_steps=1)
    state.clipped = True
    state.begin_micro_step(loader_at_end=False)
    assert not state.clipped


def test_zero_grad_on_the_boundary_resets_clipping_and_the_count() -> None:
    state = StepState(grad_accum_steps=1)
    state.clipped = True
    state.items.add(5)
    state.end_step()
    assert not state.clipped and state.items.local == 0.0 and state.items.weighted is None


def test_the_step_state_round_trips_through_a_checkpoint() -> None:
    state = StepState(grad_accum_steps=2)
    for _ in range(5):
        state.begin_micro_step(loader_at_end=False)
        if state.sync:
            state.record_step(7)
    state.skipped_steps = 1  # (one fp16 overflow: the skipped steps are counted here, once, and kept)
    saved = state.state_dict()
    other = StepState(grad_accum_steps=2)
    other.load_state_dict(saved)
    assert (other.micro_step, other.optimizer_steps, other.skipped_steps) == (5, 2, 1)
    older = StepState(grad_accum_steps=2)  # a checkpoint that kept the count in the loss scaler's state
    older.load_state_dict({"micro_step": 1, "step": 3, "scaler": {"scale": 8.0, "skipped": 2}})
    assert older.skipped_steps == 2
    older.load_state_dict({"micro_step": 1, "step": 3, "scaler": None})  # fp32: no scaler state at all
    assert older.skipped_steps == 0


class _Runner:
    def __init__(self) -> None:
        self.factors: list[float] = []

    def scale_gradients(self, factor: float) -> None:
        self.factors.append(factor)


def test_counts_add_up_over_a_window() -> None:
    count = ItemCount()
    count.add(3)
    count.add(torch.tensor(4))
    assert count.weighted and float(count.local) == 7.0
    assert torch.is_tensor(count.local) and count.local.dtype == torch.float64  # no sync per micro-batch


def test_a_window_mixing_summed_and_mean_losses_is_refused() -> None:
    count = ItemCount()
    count.add(3)
    with pytest.raises(ValueError, match="mixes summed losses"):
        count.add(None)


@pytest.mark.parametrize("bad", [-1, True, math.nan, "3", torch.tensor([1, 2]), torch.tensor(True)])
def test_a_count_that_is_not_a_count_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="num_items is the count"):
        ItemCount().add(bad)


def test_the_boundary_rescales_each_optimizer_once_by_world_times_accum_over_n() -> None:
    count = ItemCount()
    for n in (3, 5):
        count.add(n)
    a, b = _Runner(), _Runner()
    count.rescale(1, a, ONE, accum=2)
    count.rescale(1, a, ONE, accum=2)  # the same optimizer again: nothing more
    count.rescale(2, b, ONE, accum=2)
    assert a.factors == b.factors == [2 / 8]


def test_a_window_with_no_items_leaves_the_gradients() -> None:
    count = ItemCount()
    count.add(0)
    runner = _Runner()
    count.rescale(1, runner, ONE, accum=1)
    assert runner.factors == []  # factor 1.0: nothing to multiply (and no division by zero)


def test_mean_losses_are_never_rescaled() -> None:
    count = ItemCount()
    count.add(None)
    runner = _Runner()
    count.rescale(1, runner, ONE, accum=4)
    assert runner.factors == []


def test_a_backward_after_the_boundary_starts_a_new_window() -> None:
    count = ItemCount()
    count.add(4)
    count.rescale(1, _Runner(), ONE, accum=1)
    count.add(2)
    assert float(count.local) == 2.0


def test_the_metrics_record_a_summed_loss_per_item() -> None:
    assert per_item(torch.tensor(6.0), 3).item() == 2.0
    assert per_item(torch.tensor(6.0), 0).item() == 6.0  # no items: not divided by zero
    assert per_item(torch.tensor(6.0), None).item() == 6.0
