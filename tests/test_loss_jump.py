"""A loss that jumps up while training is named at the end of the run, with what to do
(lower the learning rate); the noise of a healthy run, and a resumed run, are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.observe.loss_jump import largest_jump

pytestmark = pytest.mark.quick

# The digits demo's loss read every 4 steps (dtrain demo --epochs 4 --log-every 4).
HEALTHY = [  # --lr 0.1
    2.30, 2.30, 2.30, 2.26, 2.24, 2.19, 2.13, 1.89, 1.29, 1.08, 0.50, 0.54,
    0.45, 0.45, 0.25, 0.18, 0.14, 0.32, 0.46, 0.13, 0.10, 0.11, 0.15, 0.07,
]
STUCK = [2.28, 2.25, 2.35, 2.37, 2.35, 2.33, 2.32, 2.39, 2.32, 2.40, 2.30, 2.29]  # --lr 1
SWINGING = [2.29, 2.28, 3.41, 3.60, 4.02, 3.82, 2.84, 2.66, 2.62, 6.92, 3.07, 2.82]  # --lr 3
EXPLODING = [3.68, 9.66, 10.10, 7.82, 4.37, 3.69, 3.72, 3.71, 3.57, 2.80]  # --lr 10


def _reads(losses: list[float]) -> list[tuple[int, float]]:
    return [(4 * (i + 1), loss) for i, loss in enumerate(losses)]


def test_the_largest_jump_above_an_earlier_read_is_named() -> None:
    jump = largest_jump(_reads(SWINGING))
    assert jump is not None and (jump.low_step, jump.low, jump.high_step, jump.high) == (
        8, 2.28, 40, 6.92
    )
    jump = largest_jump(_reads(EXPLODING))
    assert jump is not None and (jump.low, jump.high) == (3.68, 10.10)
    assert "Lower it." in jump.message("Lower it.") and "at step 4 to 10.1 at step 12" in (
        jump.message("")
    )


def test_healthy_noise_and_a_loss_that_never_moves_are_not_named() -> None:
    assert largest_jump(_reads(HEALTHY)) is None  # 0.13 -> 0.46: noise near a small loss
    assert largest_jump(_reads(STUCK)) is None
    assert largest_jump(_reads(SWINGING[:3])) is None  # too few reads to say


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
    results = _train([2.0, 1.9, 3.5, 1.8, 1.7], tmp_path)
    shown = capsys.readouterr().out
    assert "dtrain: note: The loss jumped from 1.9 at step 2 to 3.5 at step 3" in shown
    assert "Lower the learning rate the script sets" in shown
    assert results["loss_jump"]["to"] == 3.5 and results["loss_jump"]["from_step"] == 2
    # A resumed run starts from a loss already small, beside which noise is large.
    results = _train([0.1, 0.3, 0.1, 0.05], tmp_path / "again", tmp_path / "ckpt")
    assert "loss_jump" not in results and "jumped" not in capsys.readouterr().out
