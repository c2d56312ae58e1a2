"""Every synchronous strategy trains the same model as one process on the same global batch."""

from __future__ import annotations

from typing import Any

import pytest
from distributed import run_ranks
from torch.testing import assert_close
from training import CLOSE, train, train_variants

GPT_STEPS = 3
"""The tiny GPT's steps: AdamW moves every parameter from the first step, so a few show a
strategy that trains another model; ten cost three times as much at three processes."""


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process parameters after 10 steps on the global batch."""
    return train(strategy="single")


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_towers_match_single(reference: dict, towers: int, accumulation: int) -> None:
    params = train(strategy="towers", towers=towers, grad_accumulation=accumulation)
    assert_close(params, reference, **CLOSE)


def test_single_with_accumulation_matches_single(reference: dict) -> None:
    assert_close(train(strategy="single", grad_accumulation=2), reference, **CLOSE)


def test_ddp_at_one_process_matches_single(reference: dict) -> None:
    """Started without a launcher, as ``python script.py`` runs it (an in-memory store)."""
    variants = [{"strategy": "ddp"}, {"strategy": "ddp", "grad_accumulation": 2}]
    plain, accumulated = train_variants(variants)
    assert_close(plain, reference, **CLOSE)
    assert_close(accumulated, reference, **CLOSE)


@pytest.fixture(scope="module")
def gpt_reference() -> dict:
    """Single-process parameters of the tiny GPT after `GPT_STEPS` AdamW steps."""
    return train(strategy="single", model_name="gpt", steps=GPT_STEPS)


THREE_PROCESSES = {
    "ddp": {"strategy": "ddp"},
    "ddp+accumulation": {"strategy": "ddp", "grad_accumulation": 2},
    **{stage: {"strategy": stage} for stage in ("zero1", "zero2", "zero3")},
    **{
        f"{stage} gpt": {"strategy": stage, "model_name": "gpt", "steps": GPT_STEPS}
        for stage in ("zero1", "zero2", "zero3")
    },
    "zero3+accumulation": {"strategy": "zero3", "grad_accumulation": 2},
}
"""What runs at three processes, in one job (the habits matrix, tests/test_habits.py, runs
ddp and each zero stage at two)."""


@pytest.fixture(scope="module")
def three_processes() -> dict[str, Any]:
    """The main rank's parameters of each of `THREE_PROCESSES`, by name."""
    results = run_ranks(train_variants, 3, list(THREE_PROCESSES.values()), timeout=280)[0]
    return dict(zip(THREE_PROCESSES, results, strict=True))


@pytest.mark.timeout(300)
def test_ddp_at_three_processes_matches_single(
    reference: dict, three_processes: dict[str, Any]
) -> None:
    assert_close(three_processes["ddp"], reference, **CLOSE)
    assert_close(three_processes["ddp+accumulation"], reference, **CLOSE)


@pytest.mark.timeout(300)
def test_zero_stages_match_single(
    reference: dict, gpt_reference: dict, three_processes: dict[str, Any]
) -> None:
    for name, params in three_processes.items():
        if name.startswith("zero"):
            expected = gpt_reference if name.endswith("gpt") else reference
            assert_close(params, expected, **CLOSE, msg=lambda m, s=name: f"{s}: {m}")
