"""Every strategy runs the common optimizers (SGD with momentum, Nesterov and weight decay,
Adam, AdamW, RMSprop) exactly as one process does: parameters equal after a few steps; and
a learning-rate scheduler built before `engine.setup` drives the optimizer that trains."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from torch.testing import assert_close
from training import OPTIMIZERS, train, train_variants

STEPS = 3
RUN = {"model_name": "gpt", "steps": STEPS}
WORLD_2 = ("zero1", "zero3", "pipeline", "tensor")
"""The strategies that change what the optimizer holds: zero1 its own sharded optimizer,
zero3 DTensor shards, pipeline a stage's parameters, tensor split DTensors. ddp hands the
script's optimizer back untouched (torch's own step on averaged gradients, which every ddp
test checks), and zero2 gives it the same shards as zero3."""


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """Single-process parameters of the tiny GPT after a few steps, by optimizer."""
    found = {name: train(strategy="single", optimizer_name=name, **RUN) for name in OPTIMIZERS}
    found["scheduled"] = train(strategy="single", optimizer_name="adam", scheduler=True, **RUN)
    scheduled, constant = found["scheduled"], found["adam"]
    assert any(not torch.allclose(scheduled[k], constant[k]) for k in constant), "no effect"
    return found


@pytest.mark.timeout(120)
def test_towers_run_every_optimizer_as_single(references: dict[str, dict]) -> None:
    for name in OPTIMIZERS:
        params = train(strategy="towers", towers=2, optimizer_name=name, **RUN)
        assert_close(params, references[name], msg=lambda m, n=name: f"towers, {n}: {m}")
    params = train(strategy="towers", towers=2, optimizer_name="adam", scheduler=True, **RUN)
    assert_close(params, references["scheduled"])


@pytest.mark.timeout(400)
def test_two_process_strategies_run_every_optimizer_as_single(
    references: dict[str, dict],
) -> None:
    variants = [
        {"strategy": strategy, "optimizer_name": name, **RUN}
        for strategy in WORLD_2
        for name in OPTIMIZERS
    ] + [
        {"strategy": strategy, "optimizer_name": "adam", "scheduler": True, **RUN}
        for strategy in WORLD_2
    ]
    results = run_ranks(train_variants, 2, variants, timeout=380)[0]
    for variant, params in zip(variants, results, strict=True):
        name = "scheduled" if variant.get("scheduler") else variant["optimizer_name"]
        label = f"{variant['strategy']}, {name}"
        assert_close(params, references[name], msg=lambda m, label=label: f"{label}: {m}")
