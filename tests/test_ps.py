"""Parameter-server strategy: sync equals single-process training; modes keep their rules."""

from __future__ import annotations

from typing import Any

import pytest
from distributed import run_ranks
from torch.testing import assert_close
from training import train

SERVER = "server"


def ps_train(**options: Any) -> Any:
    """`train` under ps; a server returns SERVER once its serving loop has ended."""
    try:
        return train(strategy="ps", **options)
    except SystemExit as e:
        assert e.code in (0, None), f"a server exited with code {e.code}"
        return SERVER


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process parameters after 10 steps on the global batch."""
    return train(strategy="single")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "servers"), [(2, 1), (3, 2)])
def test_sync_ps_matches_single(reference: dict, workers: int, servers: int) -> None:
    results = run_ranks(_train_kw, workers + servers, {"nproc": workers, "servers": servers})
    assert results[workers:] == [SERVER] * servers
    for params in results[:workers]:
        assert_close(params, reference)


def _train_kw(options: dict) -> Any:
    return ps_train(**options)
