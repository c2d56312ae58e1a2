"""Scripts written as for plain PyTorch: a seed set after `dtrain.init` fixes the data order
(the shuffle seed is drawn from torch's generator when the loader is made, rank 0's draw on
every rank), and a hand-written loop (`engine.backward`, ``optimizer.step()``) gets the
step breakdown and samples/s a `train_step` loop gets."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from training import finish

import dtrain
from dtrain.data.sampler import ShardedBatchSampler

GLOBAL_BATCH = 8
STEPS = 6


def samples() -> TensorDataset:
    """48 float64 samples of 6 features and 3 classes, the same whatever torch's seed."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(48, 6, generator=generator, dtype=torch.float64)
    return TensorDataset(inputs, torch.randint(0, 3, (48,), generator=generator))


def train(
    strategy: str, seed: int, by_hand: bool = False, metrics: str | None = None, close: bool = True
) -> dict[str, torch.Tensor] | None:
    """`STEPS` steps of a script that seeds torch with `seed` after `dtrain.init` (no
    --seed), then builds its model and loader; with `by_hand`, stepping with
    `engine.backward` and ``optimizer.step()`` over the loader itself (no
    `engine.progress`). Returns the parameters (main rank)."""
    engine = dtrain.init(strategy=strategy, metrics_json=metrics)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(samples(), global_batch_size=GLOBAL_BATCH)
    for batch in loader:
        if by_hand:
            inputs, targets = engine.to_device(batch)
            engine.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.train_step(batch, F.cross_entropy)
        if engine.step == STEPS:
            break
    del model, optimizer
    return finish(engine, close)


def ddp_runs(metrics: str) -> list[Any]:
    """Under ddp, in these two processes: seeded alike after init; seeded apart after init
    (1337 + rank); by hand, seeded alike, writing `metrics`."""
    rank = int(os.environ["RANK"])
    return [
        train("ddp", 0, close=False),
        train("ddp", 1337 + rank, close=False),
        train("ddp", 0, by_hand=True, metrics=metrics),
    ]


def check_hand_metrics(path: Path, ranks: int) -> None:
    """The metrics JSON of a hand-written loop: every rank's forward, backward and
    optimizer measured, the global batch counted, a rate from them."""
    result = json.loads(path.read_text())
    assert result["steps"] == STEPS
    assert result["global_batch_size"] == GLOBAL_BATCH
    assert len(result["breakdown"]) == ranks
    for part in result["breakdown"]:
        assert part["forward"] > 0 and part["backward"] > 0 and part["optimizer"] > 0, part
    assert result["samples_per_second"] > 0


def test_a_seed_set_after_init_fixes_the_data_order(tmp_path: Path) -> None:
    """Two runs of one script whose processes start from different torch seeds (as fresh
    processes do) train alike under single, by train_step and by hand."""
    runs = []
    for first_seed in (1, 2):
        torch.manual_seed(first_seed)
        runs.append(train("single", 0))
    assert_close(runs[0], runs[1])
    torch.manual_seed(3)
    metrics = tmp_path / "single.json"
    assert_close(train("single", 0, by_hand=True, metrics=str(metrics)), runs[0])
    check_hand_metrics(metrics, ranks=1)


@pytest.mark.timeout(120)
def test_ddp_seeded_after_init_equals_single(tmp_path: Path) -> None:
    """ddp at two processes (fresh, so starting from different torch seeds) trains as
    single does with the seed set after init; ranks seeded apart after init still read one
    data order (rank 0's), so they train as single seeded as rank 0 was; a hand-written
    loop reports its breakdown and samples/s."""
    metrics = tmp_path / "ddp.json"
    alike, apart, by_hand = run_ranks(ddp_runs, 2, str(metrics), timeout=110)[0]
    torch.manual_seed(4)
    reference = train("single", 0)
    assert_close(alike, reference)
    assert_close(by_hand, reference)
    assert_close(apart, train("single", 1337))
    check_hand_metrics(metrics, ranks=2)


def test_a_resumed_epoch_is_shuffled_as_the_checkpoint_was() -> None:
    """A load restores the shuffle seed with the data position (as a checkpoint's trainer
    state records it): the next epochs shuffle with it, whatever seed the loader drew."""
    engine = dtrain.init(strategy="single")
    loader = engine.dataloader(TensorDataset(torch.arange(48)), batch_size=4)
    saved = loader.batch_sampler.seed + 1
    engine.position.shuffle_seed = saved  # what checkpoints.load restores ...
    engine.position.resume_at = (1, 5 * 4)  # ... with where the checkpoint stood
    expected = ShardedBatchSampler(48, 4, seed=saved)
    expected.set_epoch(1, skip=5)
    got = [batch.tolist() for (batch,) in engine.progress(loader, epoch=1)]
    assert got == list(expected)
    expected.set_epoch(2)
    assert [batch.tolist() for (batch,) in engine.progress(loader, epoch=2)] == list(expected)
    assert engine.position.shuffle_seed == saved  # and the next checkpoint keeps it
    engine.close()
