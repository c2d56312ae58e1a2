"""Every strategy runs the common optimizers (SGD with momentum, Nesterov and weight decay,
Adam, AdamW, RMSprop) exactly as one process does: parameters equal after a few steps."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from torch.testing import assert_close
from training import OPTIMIZERS, train, train_variants

STEPS = 3
RUN = {"model_name": "gpt", "steps": STEPS}
WORLD_2 = ("ddp", "zero1", "zero2", "zero3", "pipeline", "tensor")


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """Single-process parameters of the tiny GPT after a few steps, by optimizer."""
    return {name: train(strategy="single", optimizer_name=name, **RUN) for name in OPTIMIZERS}


@pytest.mark.timeout(120)
def test_towers_run_every_optimizer_as_single(references: dict[str, dict]) -> None:
    for name, expected in references.items():
        params = train(strategy="towers", towers=2, optimizer_name=name, **RUN)
        assert_close(params, expected, msg=lambda m, n=name: f"towers, {n}: {m}")


@pytest.mark.timeout(400)
def test_two_process_strategies_run_every_optimizer_as_single(
    references: dict[str, dict],
) -> None:
    variants = [
        {"strategy": strategy, "optimizer_name": name, **RUN}
        for strategy in WORLD_2
        for name in OPTIMIZERS
    ]
    results = run_ranks(train_variants, 2, variants, timeout=380)[0]
    for variant, params in zip(variants, results, strict=True):
        label = f"{variant['strategy']}, {variant['optimizer_name']}"
        expected = references[variant["optimizer_name"]]
        assert_close(params, expected, msg=lambda m, label=label: f"{label}: {m}")
