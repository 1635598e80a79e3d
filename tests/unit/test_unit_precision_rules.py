"""The loss scaler and the loop's rules, in one process (`shardwise.strategies.precision`,
`shardwise.engine.loop_rules`, `shardwise.accelerate.rules`)."""

from __future__ import annotations

import pytest
import torch

from shardwise.accelerate.objects import DataLoaderConfiguration, GradientAccumulationPlugin
from shardwise.accelerate.rules import accelerate_rules
from shardwise.config import LossScaleConfig
from shardwise.engine.loop_rules import LoopRules
from shardwise.strategies.precision import DynamicLossScaler, Precision

CPU = torch.device("cpu")


def _scaler(**kw: float) -> DynamicLossScaler:
    cfg = LossScaleConfig(**{"init_scale": 2.0**10, "growth_interval": 2, "hysteresis": 1, **kw})
    return DynamicLossScaler(cfg, CPU)


def test_the_loss_is_scaled_and_the_gradients_unscaled() -> None:
    scaler = _scaler()
    assert scaler.scale_loss(torch.tensor(3.0)).item() == 3.0 * 2**10
    grads = [torch.full((4,), 2.0**11), torch.full((2,), 2.0**10)]
    assert scaler.unscale_and_check(grads) is True
    assert torch.equal(grads[0], torch.full((4,), 2.0)) and torch.equal(grads[1], torch.ones(2))


def test_an_infinite_gradient_is_an_overflow() -> None:
    assert _scaler().unscale_and_check([torch.tensor([1.0, float("inf")])]) is False
    assert _scaler().unscale_and_check([torch.tensor([float("nan")])]) is False


def test_the_scale_grows_after_growth_interval_finite_steps() -> None:
    scaler = _scaler()
    scaler.update(True)
    assert scaler.scale == 2.0**10
    scaler.update(True)
    assert scaler.scale == 2.0**11


def test_an_overflow_backs_off() -> None:
    scaler = _scaler()
    scaler.update(False)
    assert scaler.scale == 2.0**9


def test_hysteresis_tolerates_overflows_before_backing_off() -> None:
    scaler = _scaler(hysteresis=3)
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2.0**10
    scaler.update(False)
    assert scaler.scale == 2.0**9


def test_the_scale_never_falls_below_min_scale() -> None:
    scaler = _scaler(init_scale=4.0, min_scale=2.0)
    for _ in range(5):
        scaler.update(False)
    assert scaler.scale == 2.0


def test_a_static_scale_stays() -> None:
    scaler = _scaler(dynamic=False)
    scaler.update(False)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 2.0**10


def test_the_scaler_round_trips_through_a_checkpoint() -> None:
    scaler = _scaler(hysteresis=2)
    scaler.update(True)
    scaler.update(False)
    other = _scaler(hysteresis=2)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()


def test_fp32_has_no_scaler_and_bf16_no_scaling() -> None:
    for name in ("fp32", "bf16"):
        precision = Precision(name, CPU)
        assert precision.scaler is None and precision.loss_scale == 1.0
        assert precision.unscale([torch.ones(2)]) is None
        assert precision.state_dict() is None
    assert Precision("fp16", CPU).loss_scale == 2.0**16  # LossScaleConfig's default


def test_the_engines_rules_are_its_defaults_and_a_bad_tail_is_refused() -> None:
    rules = LoopRules()
    assert (rules.tail, rules.resume_draws, rules.restore_loader_position) == ("split", False, True)
    assert rules.scheduler_steps_per_call(world=4) == 1
    with pytest.raises(ValueError, match="tail"):
        LoopRules(tail="even")


def test_accelerates_rules_follow_its_configuration_objects() -> None:
    rules = accelerate_rules(DataLoaderConfiguration(), None, True)
    assert (rules.tail, rules.resume_draws, rules.restore_outer_loader) == ("full", True, True)
    assert not rules.restore_loader_position and rules.scheduler_steps_per_call(world=4) == 4
    uneven = accelerate_rules(DataLoaderConfiguration(even_batches=False, split_batches=True),
                              GradientAccumulationPlugin(num_steps=2, sync_each_batch=True), False)
    assert (uneven.tail, uneven.split_batches, uneven.sync_each_batch) == ("uneven", True, True)
    assert uneven.scheduler_steps_per_call(world=4) == 1 and not uneven.step_scheduler_with_optimizer
    seeded = accelerate_rules(DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7), None, True)
    assert seeded.seedable_sampler and seeded.data_seed == 7
