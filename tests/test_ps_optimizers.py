"""Sync ps equals single-process training with every kind of optimizer the servers rebuild
from worker 0's description: SGD with momentum, Nesterov and weight decay, Adam, AdamW
(whose param groups carry a setting its constructor does not take), RMSprop, Adagrad and
Adamax, and
param groups with settings of their own over 2 servers. One spawn runs several
optimizers one after the other, the servers serving one run after another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from test_ps import SERVER, ps_config, ps_runs
from torch.testing import assert_close
from training import GLOBAL_BATCH

import dtrain
from dtrain.datasets import load_digits
from dtrain.models.digits import DigitsMLP
from dtrain.strategies.specs import lookup

STEPS = 5


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weights and biases in groups of their own settings."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if not name.endswith("weight")]
    return [{"params": weights}, {"params": biases, "lr": 3e-3, "weight_decay": 0.0}]


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "sgd-nesterov": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=2e-3),
    "adamw-groups": lambda m: torch.optim.AdamW(_groups(m), lr=1e-2, weight_decay=0.1),
}


def train_with(name: str, close: bool = True, **options: Any) -> dict[str, torch.Tensor] | None:
    """STEPS steps of the digits MLP with optimizer `name` under `options`; the parameters
    on the main rank. `close=False` keeps the process group for another run."""
    engine = dtrain.init(seed=0, **options)
    model = DigitsMLP(hidden=32)
    model, optimizer = engine.setup(model, OPTIMIZERS[name](model))
    train_set, _ = load_digits()
    loader = engine.dataloader(train_set, batch_size=GLOBAL_BATCH // engine.dp_size)
    for batch in engine.progress(loader):
        engine.train_step(batch, F.cross_entropy)
        if engine.step == STEPS:
            break
    params = engine.state_dict()
    del model, optimizer
    if close:
        engine.close()
    else:
        engine.strategy.close()
    return params


def on_workers(runs: list[tuple[str, dict[str, Any]]], workers: int, servers: int) -> list:
    """Each (optimizer name, more options) of `runs` in turn in one ps job of `workers` +
    `servers` ranks; check the servers ended; worker 0's parameters per run."""
    options = [{"name": name, **extra} for name, extra in runs]
    results = run_ranks(ps_runs, workers + servers, train_with, options, workers, servers,
                        timeout=200)  # fmt: skip
    assert results[workers:] == [SERVER] * servers
    return results[0]


CLIP = {"clip_grad_norm": 0.05}
TWO_SERVERS = [("adamw-groups", {}), ("adam", {}), ("sgd-nesterov", CLIP)]
"""The runs of 2 workers over 2 servers, in one job."""


@pytest.fixture(scope="module")
def over_two_servers() -> list:
    """Worker 0's parameters after each of `TWO_SERVERS`."""
    return on_workers(TWO_SERVERS, 2, 2)


@pytest.mark.timeout(240)
def test_sync_ps_matches_single_with_each_optimizer() -> None:
    names = ["sgd-nesterov", "adam", "adamw", "rmsprop", "adagrad", "adamax"]
    for name, params in zip(names, on_workers([(n, {}) for n in names], 2, 1), strict=True):
        expected = train_with(name, strategy="single")
        assert_close(params, expected, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(240)
def test_param_groups_over_two_servers_match_single(over_two_servers: list) -> None:
    for (name, _), params in zip(TWO_SERVERS[:2], over_two_servers[:2], strict=True):
        expected = train_with(name, strategy="single")
        assert_close(params, expected, msg=lambda m, n=name: f"{n}: {m}")


def clipped_reference() -> dict[str, torch.Tensor]:
    """`single` clipping every step (checked to differ from not clipping)."""
    expected = train_with("sgd-nesterov", strategy="single", **CLIP)
    unclipped = train_with("sgd-nesterov", strategy="single")
    assert any(not torch.allclose(expected[k], unclipped[k]) for k in expected), "never clipped"
    return expected


@pytest.mark.timeout(240)
def test_sync_ps_clips_as_single_clips(over_two_servers: list) -> None:
    """The servers clip the round's mean by its global norm, summed over the servers'
    shards."""
    assert_close(over_two_servers[2], clipped_reference())


@pytest.mark.timeout(240)
def test_ssp_with_one_worker_clips_as_single_clips() -> None:
    """ssp with one worker and staleness 0 applies that worker's gradient before its next
    step: the worker's own norm sets the factor the servers scale it by."""
    ssp = {"ps_mode": "ssp", "staleness": 0, **CLIP}
    assert_close(on_workers([("sgd-nesterov", ssp)], 1, 1)[0], clipped_reference())


def test_ps_refuses_clipping_with_backup_workers() -> None:
    with pytest.raises(dtrain.ConfigError, match="with --backup-workers is not supported"):
        lookup("ps").check_options(
            ps_config({"nproc": 3, "backup_workers": 1, "clip_grad_norm": 1.0})
        )
