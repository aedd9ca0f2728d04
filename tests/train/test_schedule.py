"""lr_at: linear warmup to the peak, cosine decay to min_lr_ratio · lr at max_steps."""

from __future__ import annotations

import math

import pytest

from looplm.train import TrainConfig, lr_at


def test_warmup_ramps_linearly_to_the_peak():
    cfg = TrainConfig(max_steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    ramp = [lr_at(s, cfg) for s in range(11)]
    assert ramp[0] > 0  # the first step already trains
    assert all(b > a for a, b in zip(ramp, ramp[1:]))
    steps = [b - a for a, b in zip(ramp, ramp[1:])]
    assert steps == pytest.approx([steps[0]] * len(steps))  # linear
    assert ramp[10] == pytest.approx(1e-3)
    assert max(lr_at(s, cfg) for s in range(200)) == pytest.approx(1e-3)


def test_cosine_decays_monotonically_to_the_floor_at_max_steps():
    cfg = TrainConfig(max_steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    decay = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(55, cfg) == pytest.approx((1e-3 + 1e-4) / 2)  # half way: cos(π/2) = 0
    assert lr_at(99, cfg) > 1e-4
    assert lr_at(250, cfg) == pytest.approx(1e-4)  # a run extended past max_steps stays at the floor


def test_no_warmup_starts_at_the_peak_and_fraction_sets_warmup():
    assert lr_at(0, TrainConfig(max_steps=10, lr=2e-3, warmup_steps=0)) == pytest.approx(2e-3)
    cfg = TrainConfig(max_steps=1000, lr=1e-3, warmup_fraction=0.05)
    assert cfg.warmup == 50 and lr_at(50, cfg) == pytest.approx(1e-3) and lr_at(49, cfg) < 1e-3


def test_schedule_is_a_pure_function_of_the_step():
    cfg = TrainConfig(max_steps=50, lr=1e-3, warmup_steps=5, min_lr_ratio=0.0)
    assert [lr_at(s, cfg) for s in range(51)] == [lr_at(s, cfg) for s in range(51)]
    assert lr_at(50, cfg) == 0.0 and math.isfinite(lr_at(3, cfg))
    with pytest.raises(ValueError):
        lr_at(-1, cfg)
