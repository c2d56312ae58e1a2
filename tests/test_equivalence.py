"""Every synchronous strategy trains the same model as one process on the same global batch."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from torch.testing import assert_close
from training import train, train_variants


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process parameters after 10 steps on the global batch."""
    return train(strategy="single")


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_towers_match_single(reference: dict, towers: int, accumulation: int) -> None:
    params = train(strategy="towers", towers=towers, grad_accumulation=accumulation)
    assert_close(params, reference)


def test_single_with_accumulation_matches_single(reference: dict) -> None:
    assert_close(train(strategy="single", grad_accumulation=2), reference)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ddp_matches_single(reference: dict, world_size: int) -> None:
    variants = [{"strategy": "ddp"}, {"strategy": "ddp", "grad_accumulation": 2}]
    plain, accumulated = run_ranks(train_variants, world_size, variants)[0]
    assert_close(plain, reference)
    assert_close(accumulated, reference)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_stages_match_single(reference: dict, world_size: int) -> None:
    variants = [{"strategy": "zero1"}, {"strategy": "zero2"}, {"strategy": "zero3"}]
    for params in run_ranks(train_variants, world_size, variants, timeout=200)[0]:
        assert_close(params, reference)
