"""A loss that jumps up while training is named at the end of the run, with what to do
(lower the learning rate); the noise of a healthy run or of fine-tuning, and a resumed
run, are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.observe.loss_jump import LossCourse

pytestmark = pytest.mark.quick

# Ten-step means of the digits demo's loss (dtrain demo --epochs 4 --log-every 1).
HEALTHY = [2.30, 2.27, 2.01, 0.94, 0.48, 0.27, 0.25, 0.15, 0.14]  # --lr 0.1
SWINGING = [2.70, 9.64, 2.95, 113.32, 2.94, 2.50, 2.42, 2.34, 2.32]  # --lr 3
# Each step's loss when fine-tuning a trained digits MLP (--log-every 1): single batches
# swing by several times the loss, which no window of ten steps does.
FINE_TUNING = [
    0.084, 0.089, 0.174, 0.081, 0.060, 0.030, 0.107, 0.093, 0.031, 0.148, 0.144, 0.052,
    0.022, 0.108, 0.247, 0.071, 0.016, 0.131, 0.072, 0.085, 0.061, 0.056, 0.020, 0.082,
    0.059, 0.063, 0.025, 0.062, 0.061, 0.202, 0.060, 0.054, 0.111, 0.164, 0.138, 0.061,
    0.055, 0.069, 0.054, 0.202, 0.168, 0.050, 0.032, 0.038, 0.094, 0.076, 0.057, 0.215,
    0.150, 0.134, 0.115, 0.052, 0.075, 0.114, 0.020, 0.072, 0.038, 0.015, 0.363, 0.073,
]


def _course(values: list[float], steps: int) -> LossCourse:
    """A course fed `values`, each the mean of `steps` steps."""
    course = LossCourse()
    for i, value in enumerate(values, 1):
        course.add(i * steps, value, steps)
    return course


def test_the_largest_jump_of_a_window_above_an_earlier_one_is_named() -> None:
    jump = _course(SWINGING, 10).jump
    assert jump is not None and (jump.low_step, jump.high_step) == (10, 40)
    assert (jump.low, jump.high) == pytest.approx((2.70, 113.32))
    message = jump.message("Lower it.")
    assert "from 2.7 (mean of the steps up to 10) to 113.3 (up to step 40)" in message
    assert message.endswith("may be too high for this batch. Lower it.")
    # Reads of fewer steps are pooled into windows of ten: the same course, the same jump.
    pooled = _course([v for v in SWINGING for _ in range(5)], 2).jump
    assert pooled is not None and pooled.high == pytest.approx(113.32)


def test_healthy_noise_and_a_fine_tuning_run_read_every_step_are_not_named() -> None:
    assert _course(HEALTHY, 10).jump is None
    assert _course(FINE_TUNING, 1).jump is None  # 0.015 -> 0.363 in single steps
    assert _course(SWINGING[:1], 10).jump is None  # one window says nothing


def _train(losses: list[float], tmp_path: Path, resume_from: Path | None = None) -> dict:
    """Train a tiny model whose loss at each step is the next of `losses`; the metrics."""
    metrics = tmp_path / "metrics.json"
    engine = dtrain.init(seed=0, log_every=1, metrics_json=str(metrics))
    model = torch.nn.Linear(2, 1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if resume_from is not None:
        engine.load(resume_from)
    batch = (torch.ones(4, 2), torch.zeros(4, 1))
    for loss in losses:
        engine.train_step(batch, lambda out, target, loss=loss: out.sum() * 0 + loss)
    engine.save(tmp_path / "ckpt")
    engine.close()
    return json.loads(metrics.read_text())


def test_a_run_whose_loss_jumps_is_told_to_lower_the_learning_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _train([2.0] * 10 + [1.8] * 10 + [3.5] * 10 + [1.7] * 10, tmp_path)
    shown = capsys.readouterr().out
    assert "dtrain: note: The loss jumped from 1.8 (mean of the steps up to 20) to 3.5" in shown
    assert "Lower the learning rate the script sets" in shown
    assert results["loss_jump"]["to"] == 3.5 and results["loss_jump"]["from_step"] == 20
    # A resumed run starts from a loss already small, beside which noise is large.
    results = _train([0.1] * 10 + [0.3] * 10, tmp_path / "again", tmp_path / "ckpt")
    assert "loss_jump" not in results and "jumped" not in capsys.readouterr().out
