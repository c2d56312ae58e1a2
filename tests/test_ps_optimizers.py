"""Sync ps equals single-process training with every kind of optimizer the servers rebuild
from worker 0's description: SGD with momentum, Nesterov and weight decay, Adam, AdamW
(whose param groups carry a setting its constructor does not take), RMSprop, Adagrad and
Adamax, and
param groups with settings of their own over 2 servers. One spawn runs several
optimizers one after the other, the servers serving one run after another."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from test_ps import SERVER, ps_config
from torch.testing import assert_close
from training import GLOBAL_BATCH

import dtrain
from dtrain.datasets import load_digits
from dtrain.models.digits import DigitsMLP
from dtrain.strategies.ps import serving
from dtrain.strategies.specs import lookup
from dtrain.topology import init_process_group

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


def ps_runs(
    names: list[str], workers: int, servers: int, extra: dict[str, Any] | None = None
) -> Any:
    """One rank of a ps job (`extra`: more options) training with each optimizer of `names`
    in turn: a worker returns its parameters per run, a server serves every run and
    returns SERVER."""
    options = {"nproc": workers, "servers": servers, **(extra or {})}
    config = ps_config(options)
    if lookup("ps").role_main(config, int(os.environ["RANK"])) is None:
        last = len(names) - 1
        return [
            train_with(name, close=i == last, strategy="ps", **options)
            for i, name in enumerate(names)
        ]
    init_process_group(serving.topology(config, server=True), config.timeout_s)
    for _ in names:
        serving.serve_job(config)
    dist.destroy_process_group()
    return SERVER


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("workers", "servers", "names"),
    [
        (2, 1, ["sgd-nesterov", "adam", "adamw", "rmsprop", "adagrad", "adamax"]),
        (2, 2, ["adamw-groups", "adam"]),
    ],
)
def test_sync_ps_matches_single_with_each_optimizer(
    workers: int, servers: int, names: list[str]
) -> None:
    results = run_ranks(ps_runs, workers + servers, names, workers, servers, timeout=200)
    assert results[workers:] == [SERVER] * servers
    for name, params in zip(names, results[0], strict=True):
        expected = train_with(name, strategy="single")
        assert_close(params, expected, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("workers", "servers", "extra"),
    [(2, 2, {}), (1, 1, {"ps_mode": "ssp", "staleness": 0})],
    ids=["sync-2-servers", "ssp-1-worker"],
)
def test_ps_clips_as_single_clips(workers: int, servers: int, extra: dict[str, Any]) -> None:
    """Sync: the servers clip the round's mean by its global norm, summed over the servers'
    shards. ssp with one worker and staleness 0 applies that worker's gradient before its
    next step: the worker's own norm sets the factor the servers scale it by."""
    clip = {"clip_grad_norm": 0.05}
    results = run_ranks(ps_runs, workers + servers, ["sgd-nesterov"], workers, servers,
                        {**extra, **clip}, timeout=200)  # fmt: skip
    assert results[workers:] == [SERVER] * servers
    expected = train_with("sgd-nesterov", strategy="single", **clip)
    unclipped = train_with("sgd-nesterov", strategy="single")
    assert any(not torch.allclose(expected[k], unclipped[k]) for k in expected), "never clipped"
    assert_close(results[0][0], expected)


def test_ps_refuses_clipping_with_backup_workers() -> None:
    with pytest.raises(dtrain.ConfigError, match="with --backup-workers is not supported"):
        lookup("ps").check_options(
            ps_config({"nproc": 3, "backup_workers": 1, "clip_grad_norm": 1.0})
        )
