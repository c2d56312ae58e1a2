"""Streams in `engine.dataloader`: every sample once per epoch over all ranks and DataLoader
workers, the same samples at step t whatever the world size, and resume by sample count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.testing import assert_close
from torch.utils.data import IterableDataset, get_worker_info
from training import finish

import dtrain
from dtrain.engine.data_side import Feeder
from dtrain.errors import ConfigError, SetupError
from dtrain.observe.progress import Throughput
from dtrain.step.position import Position

SIZE = 50  # 4 global batches of 12, and 2 samples left over
GLOBAL_BATCH = 12  # divides over 1, 2 and 3 ranks


def order(epoch: int, size: int = SIZE) -> list[int]:
    """The stream's sample ids in `epoch` (its own per-epoch shuffle)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(epoch)).tolist()


class Stream(IterableDataset):
    """Sample ids (or (features, class) pairs) in the order of `order(epoch)`. Like Hugging
    Face datasets, it splits itself over DataLoader workers (dtrain must read all of it)."""

    def __init__(self, size: int = SIZE, pairs: bool = False) -> None:
        self.size = size
        self.pairs = pairs
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        ids = order(self.epoch, self.size)
        if info is not None:
            ids = ids[info.id :: info.num_workers]
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(self.size, 6, generator=generator, dtype=torch.float64)
        targets = torch.randint(0, 3, (self.size,), generator=generator)
        for i in ids:
            yield (inputs[i], targets[i]) if self.pairs else torch.tensor(i)


class SizedStream(Stream):
    """A `Stream` that knows its length."""

    def __len__(self) -> int:
        return self.size


def feeder(world: int, rank: int, position: Position | None = None) -> Feeder:
    """Rank `rank`'s Feeder at world size `world` (no process group needed to load)."""
    return Feeder(
        world,
        rank,
        torch.device("cpu"),
        position or Position(),
        Throughput(),
        lambda _: None,
        is_main=False,
    )


def read(
    world: int,
    data: Stream,
    epoch: int = 0,
    drop_last: bool = True,
    resume_at: tuple[int, int] | None = None,
    **loader_kwargs: Any,
) -> list[list[list[int]]]:
    """Each rank's batches of `epoch` (as lists of sample ids), rank by rank."""
    per_rank = []
    for rank in range(world):
        fed = feeder(world, rank, Position(resume_at=resume_at))
        loader = fed.loader(data, None, GLOBAL_BATCH, False, drop_last, seed=0, **loader_kwargs)
        per_rank.append([batch.tolist() for batch in fed.epoch(loader, epoch, "", lambda: None)])
    return per_rank


def global_batches(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Step t's samples over all ranks, in rank order."""
    steps = max(len(batches) for batches in per_rank)
    return [
        [i for batches in per_rank if t < len(batches) for i in batches[t]] for t in range(steps)
    ]


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_and_the_same_global_batches_at_any_world_size(
    drop_last: bool,
) -> None:
    kept = SIZE if not drop_last else SIZE // GLOBAL_BATCH * GLOBAL_BATCH
    expected = order(1)[:kept]
    expected_batches = [expected[t : t + GLOBAL_BATCH] for t in range(0, kept, GLOBAL_BATCH)]
    for world in (1, 2, 3):
        for workers in (0, 1, 2):
            per_rank = read(world, Stream(), epoch=1, drop_last=drop_last, num_workers=workers)
            where = f"world {world}, {workers} workers"
            assert global_batches(per_rank) == expected_batches, where
            counts = [len(batches) for batches in per_rank]
            # Without drop_last the 2 samples left over are rank 0's (its positions 0..b-1).
            assert counts == [4 + (not drop_last)] + [4] * (world - 1), where


def test_a_sized_stream_counts_its_batches_and_persistent_workers_follow_the_epochs() -> None:
    for drop_last in (True, False):
        for rank in range(3):
            fed = feeder(3, rank)
            loader = fed.loader(SizedStream(), None, GLOBAL_BATCH, False, drop_last, seed=0)
            assert len(loader) == len(list(fed.epoch(loader, 0, "", lambda: None)))
    fed = feeder(1, 0)
    loader = fed.loader(
        SizedStream(),
        None,
        GLOBAL_BATCH,
        False,
        True,
        seed=0,
        num_workers=2,
        persistent_workers=True,
    )
    for epoch in (0, 1):
        seen = [batch.tolist() for batch in fed.epoch(loader, epoch, "", lambda: None)]
        assert seen == [order(epoch)[t : t + 12] for t in range(0, 48, 12)]
    # Fewer batches than workers: one global batch, read by the first of 3 workers.
    tiny = read(2, Stream(size=GLOBAL_BATCH), num_workers=3)
    assert global_batches(tiny) == [order(0, GLOBAL_BATCH)]


def test_a_resumed_epoch_skips_the_trained_samples_at_another_world_size() -> None:
    uninterrupted = global_batches(read(2, Stream(), epoch=1))
    # A checkpoint saved at world 2 after 1 step of epoch 1, read at world 3 with workers.
    resumed = read(3, Stream(), epoch=1, resume_at=(1, GLOBAL_BATCH), num_workers=2)
    assert global_batches(resumed) == uninterrupted[1:]
    assert read(3, Stream(), epoch=0, resume_at=(1, GLOBAL_BATCH)) == [[], [], []]
    # After the resumed epoch, a pass over the loader outside progress reads all of the next.
    fed = feeder(1, 0, Position(resume_at=(1, GLOBAL_BATCH)))
    loader = fed.loader(SizedStream(), None, GLOBAL_BATCH, False, True, seed=0)
    assert len(list(fed.epoch(loader, 1, "", lambda: None))) == 3
    assert [batch.tolist() for batch in loader] == [order(2)[t : t + 12] for t in range(0, 48, 12)]


def test_what_a_stream_cannot_honour_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="cannot shuffle it; shuffle the stream itself"):
        feeder(1, 0).loader(Stream(), 4, None, True, True, seed=0)
    with pytest.raises(SetupError, match="A stream takes no sampler"):
        feeder(1, 0).loader(Stream(), 4, None, False, True, seed=0, sampler=range(4))
    with pytest.raises(SetupError, match="A global batch of 10 does not split evenly over 3"):
        feeder(3, 0).loader(Stream(), None, 10, False, True, seed=0)
    with pytest.raises(SetupError, match="give the dataset a __len__, or use drop_last=True"):
        feeder(2, 0).loader(Stream(), None, 12, False, False, seed=0, collective_forward=True)
    with pytest.raises(ConfigError, match="The stream has 10 samples than one global batch"):
        feeder(2, 0).loader(SizedStream(size=10), None, 12, False, True, seed=0)
    with pytest.raises(ConfigError, match="The stream has fewer samples than one global batch"):
        read(2, Stream(size=10))


STEPS = 7  # 4 steps in epoch 0, 3 in epoch 1
SAVED_AT = 5  # 1 step into epoch 1


def train(
    strategy: str,
    steps: int = STEPS,
    load: str | None = None,
    save: str | None = None,
    workers: int = 0,
    close: bool = True,
) -> dict[str, torch.Tensor] | None:
    """Train a float64 MLP on `Stream` pairs to step `steps`, from the checkpoint `load` if
    given, saving one at `save` if given; the parameters (main rank)."""
    engine = dtrain.init(strategy=strategy, seed=0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    if load is not None:
        engine.load(load)
    loader = engine.dataloader(
        Stream(pairs=True), global_batch_size=GLOBAL_BATCH, num_workers=workers
    )
    epoch = engine.epoch
    while engine.step < steps:
        for batch in engine.progress(loader, epoch):
            engine.train_step(batch, F.cross_entropy)
            if engine.step == steps:
                break
        epoch += 1
    if save is not None:
        engine.save(save)
    del model, optimizer
    return finish(engine, close)


def at_two_ranks(path: str) -> tuple[Any, Any]:
    """Under ddp: uninterrupted, and resumed from the checkpoint at `path`."""
    return train("ddp", close=False), train("ddp", load=path)


@pytest.mark.timeout(120)
def test_a_stream_trains_as_single_and_resumes_at_another_world_size(tmp_path: Path) -> None:
    reference = train("single")
    path = str(tmp_path / "ckpt")
    train("single", SAVED_AT, save=path, workers=2)
    uninterrupted, resumed = run_ranks(at_two_ranks, 2, path)[0]
    assert_close(uninterrupted, reference)
    assert_close(resumed, reference)
    assert_close(train("single", load=path, workers=1), reference)
