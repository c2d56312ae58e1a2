"""Optimizers that hold no state save and load under every strategy, in both checkpoint
formats: SGD without momentum (the README's quickstart), and Adam saved before its first
step. Each strategy saves; then each loads what two others saved (`others`) into an
optimizer that has state of its own and another learning rate, and takes a step, which
must land where `single` lands without the load.

`single` and `towers` run in this process, before and after one spawned job of two
processes that runs the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from habits import BATCH, Habit, HabitNet, dataset, loss_fn
from torch.testing import assert_close
from training import finish

import dtrain

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    # Adam's first step is about lr * sign(gradient): with torch's eps 1e-8 a gradient near
    # zero summed in another order flips it; a larger eps keeps the comparison about loading.
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-3),
}
"""Optimizers whose checkpoints hold no state tensors: SGD steps once before it saves
(and still holds none), Adam saves before its first step."""
STEPS_BEFORE_SAVE = {"sgd": 1, "adam": 0}
OTHER_BATCH = 3
"""The batch of the step before each load, which no run takes otherwise."""

IN_PROCESS = {"single": {}, "towers": {"towers": 2}}
AT_TWO = {
    "ddp": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "hsdp": {"shard_size": 2},
    "local-sgd": {"sync_every": 1},
    "pipeline": {"pp": 2},
    "tensor": {"tp": 2},
}
"""Strategy -> options of dtrain.init, by where they run."""
FORMATS = ("consolidated", "sharded")
SYNCHRONOUS_ONLY_WITH = {"local-sgd": "sgd"}
"""Strategies that train as one process does only under this optimizer (local-sgd,
syncing after every step, averages plain SGD's updates; Adam's it does not): under the
others, their load is compared with their own step without a load."""


def _batch(engine: dtrain.Engine, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of `step`."""
    inputs, targets = dataset()[step * BATCH : (step + 1) * BATCH]
    per = BATCH // engine.dp_size
    first = engine.strategy.placement.dp_rank * per
    return inputs[first : first + per], targets[first : first + per]


def _step(engine: dtrain.Engine) -> None:
    engine.train_step(_batch(engine, engine.step), loss_fn)


def run(
    strategy: str, optimizer_name: str, root: Path, sources: list[str], close: bool = True
) -> dict[str, Any]:
    """Under `strategy`, without `sources`: save in both formats under `root` after
    STEPS_BEFORE_SAVE steps, take one more step and return the parameters then ("own").
    With `sources`: for each checkpoint the strategies `sources` saved, change the
    learning rate and take a step on another batch, load the checkpoint, take one step and
    return the parameters then (by "source/format"). Parameters on the main rank (None
    elsewhere)."""
    engine = dtrain.init(seed=0, **{**IN_PROCESS, **AT_TWO}[strategy], strategy=strategy)
    model = HabitNet(Habit())
    model, optimizer = engine.setup(model, OPTIMIZERS[optimizer_name](model.parameters()))
    results = {}
    if not sources:
        for _ in range(STEPS_BEFORE_SAVE[optimizer_name]):
            _step(engine)
        for checkpoint_format in FORMATS:
            engine.config.checkpoint_format = checkpoint_format
            engine.save(root / optimizer_name / f"{strategy}-{checkpoint_format}")
        _step(engine)
        results["own"] = engine.state_dict()
    for source in sources:
        for checkpoint_format in FORMATS:
            # State of its own and another learning rate, which the load must replace.
            for group in optimizer.param_groups:
                group["lr"] *= 10
            engine.train_step(_batch(engine, OTHER_BATCH), loss_fn)
            engine.load(root / optimizer_name / f"{source}-{checkpoint_format}")
            _step(engine)
            results[f"{source}/{checkpoint_format}"] = engine.state_dict()
    del model, optimizer
    finish(engine, close)
    return results


def others(strategy: str) -> list[str]:
    """The strategies whose checkpoints `strategy` loads: single's (towers' for single)
    and the next one's in the order of IN_PROCESS and AT_TWO, so that every strategy's
    checkpoint is read by another layout and every strategy reads two others."""
    order = [*IN_PROCESS, *AT_TWO]
    first = "towers" if strategy == "single" else "single"
    i = order.index(strategy)
    after = [s for s in order[i + 1 :] + order[:i] if s not in (first, strategy)]
    return [first, after[0]]


def run_at_two(root: Path) -> dict[str, dict[str, Any]]:
    """Every strategy of AT_TWO under every optimizer, one after the other in this process
    group: first each saves, then each loads what two others saved."""
    plan = [
        (name, strategy, sources)
        for name in OPTIMIZERS
        for sources in (False, True)
        for strategy in AT_TWO
    ]
    results: dict[str, dict[str, Any]] = {}
    for i, (name, strategy, loads) in enumerate(plan):
        sources = others(strategy) if loads else []
        ran = run(strategy, name, root, sources, close=i == len(plan) - 1)
        results.setdefault(f"{name}/{strategy}", {}).update(ran)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every strategy's results by "optimizer/strategy": its own step after saving
    ("own"), and its step after loading each checkpoint of `others`."""
    root = tmp_path_factory.mktemp("stateless")
    done = {
        f"{name}/{strategy}": run(strategy, name, root, [])
        for name in OPTIMIZERS
        for strategy in IN_PROCESS
    }
    done.update(run_ranks(run_at_two, 2, root, timeout=400)[0])
    for name in OPTIMIZERS:
        for strategy in IN_PROCESS:
            done[f"{name}/{strategy}"].update(run(strategy, name, root, others(strategy)))
    return done


@pytest.mark.timeout(420)
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", [*IN_PROCESS, *AT_TWO])
def test_every_checkpoint_loads_and_continues_as_single(
    results: dict[str, dict[str, Any]], strategy: str, optimizer_name: str
) -> None:
    runs = results[f"{optimizer_name}/{strategy}"]
    expected = results[f"{optimizer_name}/single"]["own"]
    if SYNCHRONOUS_ONLY_WITH.get(strategy, optimizer_name) != optimizer_name:
        expected = runs["own"]
    else:
        assert_close(runs["own"], expected, rtol=1e-4, atol=1e-4)
    loads = [f"{source}/{f}" for source in others(strategy) for f in FORMATS]
    assert sorted(k for k in runs if k != "own") == sorted(loads)
    for load in loads:
        assert_close(runs[load], expected, rtol=1e-4, atol=1e-4, msg=lambda m, w=load: f"{w}: {m}")
