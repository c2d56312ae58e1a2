"""Every synchronous strategy trains the same model as one process on the same global batch."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from torch.testing import assert_close
from training import CLOSE, train, train_variants


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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ddp_matches_single(reference: dict, world_size: int) -> None:
    variants = [{"strategy": "ddp"}, {"strategy": "ddp", "grad_accumulation": 2}]
    plain, accumulated = run_ranks(train_variants, world_size, variants)[0]
    assert_close(plain, reference, **CLOSE)
    assert_close(accumulated, reference, **CLOSE)


@pytest.fixture(scope="module")
def gpt_reference() -> dict:
    """Single-process parameters of the tiny GPT after 10 AdamW steps."""
    return train(strategy="single", model_name="gpt")


@pytest.mark.timeout(300)
def test_zero_stages_match_single(reference: dict, gpt_reference: dict) -> None:
    """At three processes (the habits matrix, tests/test_habits.py, runs each stage at two)."""
    stages = ["zero1", "zero2", "zero3"]
    variants = [{"strategy": s} for s in stages] + [
        {"strategy": s, "model_name": "gpt"} for s in stages
    ]
    variants.append({"strategy": "zero3", "grad_accumulation": 2})
    results = run_ranks(train_variants, 3, variants, timeout=280)[0]
    for stage, params in zip([*stages, *stages, "zero3+accumulation"], results, strict=True):
        expected = reference if len(params) == len(reference) else gpt_reference
        assert_close(params, expected, **CLOSE, msg=lambda m, s=stage: f"{s}: {m}")
