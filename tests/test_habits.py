"""The habits matrix: one script of ordinary PyTorch habits (tests/habits.py) under every
strategy, each habit equal to `single` on the same global batch or refused by name before
it trains a wrong model."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
from distributed import run_ranks
from habits import HABITS, run_habit, run_habits, run_ps_habits, run_strategies
from torch.testing import assert_close
from training import CLOSE

EVERY = [name for name in HABITS if name != "compiled"]
"""The habits every strategy runs; "compiled" traces each block (seconds per process), so
it runs under zero3 and tensor (where the issue was found; zero2 wraps the blocks as zero3
does) and parameter servers."""

BY_HAND = ["accumulate_no_sync", "accumulate_plain", "clip"]

REFUSED: dict[tuple[str, str], str] = {
    **{(s, "hook"): "carry a gradient hook" for s in ("zero2", "zero3", "hybrid")},
    **{("pipeline", name): "run inside engine.train_step" for name in BY_HAND},
    ("ps", "clip"): "A gradient was changed between backward and optimizer.step",
}
"""(strategy, habit) -> what the refusal must say; every other cell equals `single`."""

SAME_AS_SINGLE_WITH: dict[tuple[str, str], dict[str, Any]] = {
    # Four micro-batches normalise one after another, as `single` accumulating four does.
    ("pipeline", "batchnorm"): {"grad_accumulation": 4},
}


BF16_CLOSE = {"rtol": 1e-2, "atol": 1e-3}
"""bf16-mixed against `single` in bf16-mixed: a bf16 step rounds to about 4e-3 of a value,
and FSDP2's policy casts the parameters where autocast casts the operations (1.2e-4 apart
after 4 steps here); a layer that missed its 4 updates is 4e-3 to 2e-2 away."""


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """`single`'s parameters for every habit."""
    return {name: run_habit("single", name) for name in HABITS}


def _check(strategy: str, results: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every habit of `results` equal to `single` or refused as REFUSED says."""
    for name, params in results.items():
        refusal = REFUSED.get((strategy, name))
        if refusal is not None:
            assert isinstance(params, str) and refusal in params, f"{strategy}/{name}: {params}"
            continue
        assert not isinstance(params, str), f"{strategy}/{name}: {params}"
        expected = reference[name]
        if (strategy, name) in SAME_AS_SINGLE_WITH:
            expected = run_habit("single", name, extra=SAME_AS_SINGLE_WITH[strategy, name])
        close = BF16_CLOSE if name == "bf16" else CLOSE
        assert_close(params, expected, **close, msg=lambda m, n=name: f"{strategy}/{n}: {m}")


def habits_of(strategy: str) -> list[str]:
    """The habits `strategy` runs at two processes."""
    return [*EVERY, "compiled"] if strategy in ("zero3", "tensor") else EVERY


JOBS_OF_TWO = [("ddp", "zero1", "zero2"), ("zero3", "pipeline", "tensor")]
"""The strategies run at two processes, by job: a job runs its strategies one after the
other (a spawn per strategy costs seconds of process start; two jobs keep each within its
first test's timeout)."""


@pytest.fixture(scope="module")
def two_processes() -> Callable[[str], dict[str, Any]]:
    """The results of one strategy's habits at two processes, from its job (run once, when
    the first of its strategies' tests asks)."""
    done: dict[tuple[str, ...], dict[str, dict[str, Any]]] = {}

    def results(strategy: str) -> dict[str, Any]:
        job = next(job for job in JOBS_OF_TWO if strategy in job)
        if job not in done:
            plan = {s: habits_of(s) for s in job}
            done[job] = run_ranks(run_strategies, 2, plan, timeout=280)[0]
        return done[job][strategy]

    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [s for job in JOBS_OF_TWO for s in job])
def test_every_habit_under_two_processes(
    strategy: str,
    reference: dict[str, Any],
    two_processes: Callable[[str], dict[str, Any]],
) -> None:
    _check(strategy, two_processes(strategy), reference)


@pytest.mark.timeout(300)
def test_every_habit_under_parameter_servers(reference: dict[str, Any]) -> None:
    names = [*EVERY, "compiled"]
    results = run_ranks(run_ps_habits, 3, names, 2, 1, timeout=280)[0]
    _check("ps", results, reference)


def test_every_habit_under_towers(reference: dict[str, Any]) -> None:
    names = [name for name in EVERY if name != "rank_seed"]  # one process: no ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_habits("towers", names)
    # Each tower normalises its share, as nn.DataParallel does: said, naming the layers.
    batchnorm = results.pop("batchnorm")
    assert any("blocks.0.bn" in str(w.message) for w in caught)
    assert not isinstance(batchnorm, str)
    _check("towers", results, reference)


AT_THREE = ["tied", "sometimes_unused", "batchnorm", "rank_seed", "accumulate_no_sync"]


@pytest.fixture(scope="module")
def three_processes() -> dict[str, dict[str, Any]]:
    """The results of `AT_THREE` under ddp and zero3, in one job of three processes."""
    plan = {strategy: AT_THREE for strategy in ("ddp", "zero3")}
    return run_ranks(run_strategies, 3, plan, timeout=280)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_some_habits_under_three_processes(
    strategy: str, reference: dict[str, Any], three_processes: dict[str, dict[str, Any]]
) -> None:
    _check(strategy, three_processes[strategy], reference)


@pytest.mark.timeout(300)
def test_some_habits_under_hybrid(reference: dict[str, Any]) -> None:
    """dp 2 x pp 2: stages replicated with FSDP2's replicate."""
    names = ["plain", "tied", "frozen_in_optimizer", "groups", "onecycle", "dict_output", "hook"]
    results = run_ranks(run_habits, 4, "hybrid", names, timeout=280)[0]
    _check("hybrid", results, reference)
