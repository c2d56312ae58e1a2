"""BatchNorm under data parallelism without --sync-batchnorm normalises each worker's share
of the batch, so the model trains differently from one device: dtrain says so once at
setup, naming the layers and the flag, wherever the flag would be accepted."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dtrain.config import Config
from dtrain.process.topology import Topology
from dtrain.strategies.base import Strategy
from dtrain.strategies.specs import lookup

TWO = Topology(rank=0, world_size=2, local_rank=0, local_world_size=2,
               device=torch.device("cpu"), backend="gloo")  # fmt: skip


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _notes(topology: Topology, model: nn.Module | None = None, **options: object) -> list[str]:
    config = Config(**options)
    strategy = Strategy(config, topology, lookup(config.strategy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy._note_unsynced_batchnorm(model or _model())
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_data_parallel_batchnorm_is_named_with_the_flag(strategy: str) -> None:
    (note,) = _notes(TWO, strategy=strategy, nproc=2)
    assert "1 normalise each process's share of the batch (1/2 of it)" in note
    assert "--sync-batchnorm" in note


def test_ps_in_sync_mode_is_told_too() -> None:
    (note,) = _notes(TWO, strategy="ps", nproc=2, servers=1)
    assert "--sync-batchnorm" in note


def test_nothing_to_say_where_the_flag_is_given_refused_or_useless() -> None:
    assert not _notes(TWO, strategy="ddp", nproc=2, sync_batchnorm=True)
    assert not _notes(TWO, strategy="ps", nproc=2, servers=1, ps_mode="async")
    assert not _notes(TWO, strategy="local-sgd", nproc=2, sync_every=2)
    assert not _notes(TWO, strategy="ddp", nproc=2, model=nn.Linear(4, 2))
    one = Topology(0, 1, 0, 1, torch.device("cpu"), "gloo")
    assert not _notes(one, strategy="ddp", nproc=1)
