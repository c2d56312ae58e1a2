"""Seeding in `dtrain.init`: ``--seed S`` seeds every generator on every rank, and the data
shuffle; without it a seed the script set alike on every rank is kept, ranks that start
apart are all given rank 0's seed, so the replicas agree, and the data shuffle takes rank
0's draw from torch's generator when the loader is made."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from distributed import run_ranks
from torch.testing import assert_close

import dtrain
from dtrain.data.sampler import ShardedBatchSampler
from dtrain.demo.script import parse_args


class Collect(logging.Handler):
    """Keeps the messages of the ``dtrain`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def expected(seed: int) -> dict[str, object]:
    """What each generator draws first after being seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "torch": torch.rand(3, generator=generator),
        "python": random.Random(seed).random(),
        "numpy": float(np.random.RandomState(seed).rand()),
    }


def draws() -> dict[str, object]:
    """What each global generator draws next."""
    return {"torch": torch.rand(3), "python": random.random(), "numpy": float(np.random.rand())}


def first_shuffle_seed(seed: int) -> int:
    """The shuffle seed a loader made first after torch was seeded with `seed` draws."""
    generator = torch.Generator().manual_seed(seed)
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def one_rank(
    own_seed: int | None, apart: bool = False, seed: int | None = None, close: bool = False
) -> dict:
    """Seed this rank's generators with `own_seed` (plus the rank when `apart`), start a
    ddp Engine (with `seed` if given), and return what the generators draw next, the run's
    seed, the shuffle seed of a loader made then (after torch is seeded again as before
    init: without `seed` the loader draws from it) and what the ``dtrain`` logger said.
    Without `close`, only the strategy is closed: the process group stays for the next."""
    mine = None
    if own_seed is not None:
        mine = own_seed + int(os.environ["RANK"]) if apart else own_seed
        torch.manual_seed(mine)
        random.seed(mine)
        np.random.seed(mine)
    collect = Collect()
    logger = logging.getLogger("dtrain")
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)  # as engine.log_to sets it: the note goes to the log file
    try:
        engine = dtrain.init(strategy="ddp", seed=seed)
    finally:
        logger.removeHandler(collect)
    result = {**draws(), "seed": engine.seed, "logs": collect.messages}
    if mine is not None:
        torch.manual_seed(mine)
    data = torch.utils.data.TensorDataset(torch.zeros(8, 1))
    result["shuffle"] = engine.dataloader(data, batch_size=2).batch_sampler.seed
    if close:
        engine.close()
    else:
        engine.strategy.close()
    return result


def every_case() -> dict[str, dict]:
    """`one_rank` for each case of this file in one job of two ranks, "unseeded" first:
    each process still holds the seed torch drew for it at start."""
    return {
        "unseeded": one_rank(None),
        "alike": one_rank(123),
        "apart": one_rank(100, apart=True),
        "apart, given 5": one_rank(100, apart=True, seed=5, close=True),
    }


@pytest.fixture(scope="module")
def cases() -> list[dict[str, dict]]:
    """`every_case()` by rank."""
    return run_ranks(every_case, 2, timeout=80)


def generators(result: dict) -> dict:
    return {k: result[k] for k in ("torch", "python", "numpy")}


def test_a_seed_set_before_init_is_kept_in_one_process() -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    engine = dtrain.init(strategy="single")
    assert_close(draws(), expected(123))
    assert engine.seed is None and engine.config.seed is None
    engine.close()


def test_a_seed_given_to_init_reseeds_one_process() -> None:
    torch.manual_seed(123)
    engine = dtrain.init(strategy="single", seed=5)
    assert_close(draws(), expected(5))
    assert engine.seed == 5
    engine.close()


@pytest.mark.timeout(90)
def test_a_seed_set_alike_on_every_rank_is_kept(cases: list[dict[str, dict]]) -> None:
    for got in (case["alike"] for case in cases):
        assert_close(generators(got), expected(123))
        assert (got["seed"], got["shuffle"], got["logs"]) == (None, first_shuffle_seed(123), [])


@pytest.mark.timeout(90)
def test_a_seed_given_to_init_reseeds_every_rank(cases: list[dict[str, dict]]) -> None:
    for got in (case["apart, given 5"] for case in cases):
        assert_close(generators(got), expected(5))
        assert (got["seed"], got["shuffle"], got["logs"]) == (5, 5, [])


@pytest.mark.timeout(90)
def test_ranks_seeded_apart_all_get_rank_0s_seed_and_are_told(
    cases: list[dict[str, dict]],
) -> None:
    first, second = (case["apart"] for case in cases)
    for got in (first, second):
        assert_close(generators(got), expected(100))
        assert got["seed"] is None
    assert first["shuffle"] == second["shuffle"] == first_shuffle_seed(100)  # rank 0's
    assert len(first["logs"]) == 1 and "seeded with rank 0's (100)" in first["logs"][0]
    assert "--seed S" in first["logs"][0]
    assert second["logs"] == []  # rank 0 alone says it


@pytest.mark.timeout(90)
def test_unseeded_ranks_start_equal(cases: list[dict[str, dict]]) -> None:
    """Fresh processes each draw their own torch seed; init gives every rank rank 0's."""
    first, second = (case["unseeded"] for case in cases)
    assert_close(generators(first), generators(second))
    assert first["seed"] is second["seed"] is None
    assert first["shuffle"] == second["shuffle"]


def test_any_seed_torch_accepts_shuffles() -> None:
    sampler = ShardedBatchSampler(10, 2, seed=2**64 - 1)
    assert sorted(i for batch in sampler for i in batch) == list(range(10))


SCRIPT = """
import torch
import dtrain
engine = dtrain.init()
loader = engine.dataloader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=2)
print(f"seed {engine.seed} config {engine.config.seed} shuffle {loader.batch_sampler.seed}")
"""


@pytest.mark.timeout(120)
def test_dtrain_run_seed_reaches_the_script(tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text(SCRIPT)
    proc = run_cli("run", "--seed", "7", "report.py", cwd=tmp_path, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "seed 7 config 7 shuffle 7" in proc.stdout


def test_the_demo_takes_seed_as_a_topology_flag(tmp_path: Path) -> None:
    assert parse_args(["--seed", "3", "--out", str(tmp_path)]).seed == 3
    assert parse_args(["--out", str(tmp_path)]).seed is None  # the demo then uses 0
