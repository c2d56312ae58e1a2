"""Learning-rate rules: the classic example (batch 100 at lr 0.001 becomes batch 400 at
lr 0.002) and Goyal et al.'s linear rule with warmup."""

from __future__ import annotations

import pytest

from dtrain.demo.lr import LRSchedule, scale_lr
from dtrain.errors import ConfigError


def test_seeds_example_is_the_sqrt_rule() -> None:
    # One GPU at batch 100, lr 0.001 -> four GPUs at batch 400, lr 0.002.
    assert scale_lr(0.001, 400, 100, "sqrt") == pytest.approx(0.002)


def test_linear_and_none() -> None:
    assert scale_lr(0.1, 8192, 256, "linear") == pytest.approx(3.2)
    assert scale_lr(0.1, 8192, 256, "none") == 0.1


def test_unknown_rule_is_refused() -> None:
    with pytest.raises(ConfigError, match="linear"):
        scale_lr(0.1, 64, 64, "cubic")


def test_schedule_warms_up_then_decays_to_zero() -> None:
    schedule = LRSchedule(peak=1.0, start=0.25, warmup_steps=4, total_steps=12)
    assert schedule(0) == 0.25
    assert schedule(2) == pytest.approx(0.625)
    assert schedule(4) == 1.0
    assert schedule(8) == pytest.approx(0.5)
    assert schedule(12) == pytest.approx(0.0)


def test_a_batch_far_above_ten_samples_per_class_is_noted_for_the_demo() -> None:
    from dtrain.models.recipes import DIGITS, TEXT

    assert DIGITS.batch_note(64) is None and DIGITS.batch_note(100) is None
    note = DIGITS.batch_note(512)
    assert note is not None and "a global batch of 512 holds more than 10 samples per class" in note
    assert "(--epochs), or keep the batch near 100" in note
    assert TEXT.batch_note(4096) is None  # language modelling has no such rule
