"""Sharded loading: the samples of step t do not depend on the number of workers."""

from __future__ import annotations

import contextlib
import io
import logging
import logging.handlers
import queue
from typing import Any

import pytest
import torch
from distributed import run_ranks

import dtrain
from dtrain.data.sampler import ShardedBatchSampler
from dtrain.engine.data_side import Feeder
from dtrain.errors import ConfigError, SetupError
from dtrain.observe.progress import Throughput
from dtrain.step.position import Position


def shares(world: int, global_batch: int = 12, size: int = 100, epoch: int = 0) -> list[list[int]]:
    """Each rank's batches for one epoch, rank by rank."""
    out = []
    for rank in range(world):
        sampler = ShardedBatchSampler(size, global_batch // world, world, rank, seed=3)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_global_batches_are_the_same_at_any_world_size(world: int) -> None:
    single = shares(1)[0]
    per_rank = shares(world)
    assert all(len(batches) == len(single) for batches in per_rank)
    for step, global_batch in enumerate(single):
        joined = [i for rank in range(world) for i in per_rank[rank][step]]
        assert joined == global_batch


def test_shares_are_disjoint_and_drop_the_partial_batch() -> None:
    per_rank = shares(2, global_batch=12, size=100)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == 96  # 8 full global batches of 12; 4 dropped


def test_each_epoch_has_its_own_shuffle_and_iteration_moves_on() -> None:
    sampler = ShardedBatchSampler(100, 10, seed=1)
    first, second = list(sampler), list(sampler)
    assert first != second
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_skip_resumes_inside_an_epoch() -> None:
    sampler = ShardedBatchSampler(100, 10, seed=1)
    full = list(sampler)
    sampler.set_epoch(0, skip=4)
    assert list(sampler) == full[4:]


def test_evaluation_keeps_the_partial_batch_split_over_ranks() -> None:
    seen = []
    for rank in range(3):
        sampler = ShardedBatchSampler(25, 4, 3, rank, shuffle=False, drop_last=False)
        seen += [i for batch in sampler for i in batch]
    assert sorted(seen) == list(range(25))


def test_a_data_set_smaller_than_one_global_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        ShardedBatchSampler(10, 8, dp_size=2)


def test_a_stream_is_loaded_in_its_own_order_and_not_shuffled() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(10)

    engine = dtrain.init(strategy="single")
    loader = engine.dataloader(Stream(), batch_size=4)  # the last 2 samples are dropped
    assert [batch.tolist() for batch in engine.progress(loader)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="shuffle the stream itself"):
        engine.dataloader(Stream(), batch_size=2, shuffle=True)
    engine.close()


def unsharded_warning() -> str:
    """What rank 0 prints when the ddp workers iterate one plain DataLoader (the process
    group stays for the next check)."""
    engine = dtrain.init(strategy="ddp")
    engine.setup(torch.nn.Linear(2, 2), None)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in engine.progress(loader):
            break
    engine.strategy.close()
    return printed.getvalue()


def global_batch_shares() -> tuple[int, str]:
    """The per-worker batch of a global 12, and the refusal of a global 64."""
    engine = dtrain.init(strategy="ddp")
    data = torch.utils.data.TensorDataset(torch.zeros(30, 2))
    per_worker = engine.dataloader(data, global_batch_size=12).batch_sampler.batch_size
    with pytest.raises(SetupError) as refused:
        engine.dataloader(data, global_batch_size=64)
    engine.close()
    return per_worker, str(refused.value)


def three_workers() -> dict[str, Any]:
    """Both checks above, one after the other, in one job of three ddp workers."""
    return {"warning": unsharded_warning(), "shares": global_batch_shares()}


@pytest.fixture(scope="module")
def at_three() -> dict[str, Any]:
    """`three_workers()` on the main rank."""
    return run_ranks(three_workers, 3)[0]


@pytest.mark.timeout(60)
def test_a_plain_loader_under_ddp_is_warned_about(at_three: dict[str, Any]) -> None:
    said = at_three["warning"]
    assert "this loader is not sharded, so each of the 3 data-parallel workers" in said


def test_the_unsharded_warning_is_shown_once_for_two_ranks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)))

    def both_ranks() -> None:
        for rank in (0, 1):  # the main rank says it; the other one only logs it
            say = print if rank == 0 else (lambda line: None)
            feeder = Feeder(2, rank, torch.device("cpu"), Position(), Throughput(), say, rank == 0)
            next(feeder.epoch(loader, 0, "epoch 0", lambda: None))

    # A script that configures no logging: logging's last resort would print each record.
    monkeypatch.setattr(logging.root, "handlers", [])
    both_ranks()
    shown = capsys.readouterr()
    assert (shown.out + shown.err).count("this loader is not sharded") == 1
    # A script that configures logging still gets each rank's record.
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    monkeypatch.setattr(logging.root, "handlers", [logging.handlers.QueueHandler(records)])
    both_ranks()
    assert sum("not sharded" in records.get().getMessage() for _ in range(records.qsize())) == 2


@pytest.mark.timeout(60)
def test_the_global_batch_can_be_given_and_must_divide(at_three: dict[str, Any]) -> None:
    per_worker, refused = at_three["shares"]
    assert per_worker == 4
    assert "A global batch of 64 does not split evenly over 3 data-parallel workers" in refused
