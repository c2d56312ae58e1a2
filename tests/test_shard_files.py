"""Shard files in engine.dataloader: every sample once per epoch, the same global batches at
any world size, each rank opening only its partition's files, resume straight at step t."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli
from distributed import run_ranks
from test_cli import demo
from test_cli_fast import cli_without_torch
from test_streams import feeder, global_batches
from torch import nn
from torch.testing import assert_close
from training import finish

import dtrain
from dtrain.data.shard_files import ShardFiles
from dtrain.data.shard_share import ShardShare
from dtrain.data.shard_write import write_shards
from dtrain.datasets import load_text
from dtrain.demo.script import check_shards
from dtrain.errors import ConfigError, SetupError
from dtrain.step.position import Position

SIZE = 48  # 2 partitions of 24 = shards of 5, 5, 5, 5, 4
SHARD = 5
GLOBAL_BATCH = 12  # 4 steps an epoch; divides over 1, 2, 3 and 4 ranks
STEPS = 4


def ids(directory: Path, partitions: int, size: int = SIZE, fmt: str = "pt") -> Path:
    """Shards of the sample ids 0..size-1."""
    return write_shards([torch.tensor(i) for i in range(size)], directory, SHARD, partitions, fmt)


def read(
    files: ShardFiles | Path,
    world: int,
    epoch: int = 0,
    shuffle: bool = True,
    resume_at: tuple[int, int] | None = None,
    **loader_kwargs: Any,
) -> list[list[list[int]]]:
    """Each rank's batches of `epoch` (lists of sample ids), rank by rank; a directory is
    opened afresh for each rank (as each process would)."""
    per_rank = []
    for rank in range(world):
        data = files if isinstance(files, ShardFiles) else ShardFiles(files, shuffle_block=2)
        fed = feeder(world, rank, Position(resume_at=resume_at))
        loader = fed.loader(data, None, GLOBAL_BATCH, shuffle, True, seed=3, **loader_kwargs)
        per_rank.append([batch.tolist() for batch in fed.epoch(loader, epoch, "", lambda: None)])
    return per_rank


def test_every_sample_once_and_the_same_global_batches_at_any_world_size(
    tmp_path: Path,
) -> None:
    for partitions, worlds in ((1, (1, 2, 3, 4)), (2, (1, 2, 4))):
        directory = ids(tmp_path / f"p{partitions}", partitions)
        reference = global_batches(read(directory, 1, epoch=1))
        assert sorted(i for batch in reference for i in batch) == list(range(SIZE))
        assert reference != global_batches(read(directory, 1, epoch=0))  # a new order
        if partitions == 2:  # step t takes 6 samples of each partition's 24
            assert all(max(batch[:6]) < 24 <= min(batch[6:]) for batch in reference)
        for world in worlds:
            for workers in (0, 2) if world > 1 else (1, 2):
                per_rank = read(directory, world, epoch=1, num_workers=workers)
                where = f"{partitions} partitions, world {world}, {workers} workers"
                assert global_batches(per_rank) == reference, where
                assert [len(batches) for batches in per_rank] == [STEPS] * world, where


def test_the_order_shuffles_shards_then_samples_within_blocks_of_shards(tmp_path: Path) -> None:
    files = ShardFiles(ids(tmp_path / "d", 1, size=50), shuffle_block=2)  # 10 shards of 5
    order = files.order(0, seed=3, epoch=0).tolist()
    blocks = [order[start : start + 2 * SHARD] for start in range(0, 50, 2 * SHARD)]
    assert all(len({i // SHARD for i in block}) == 2 for block in blocks)  # 2 whole shards
    assert any(block != sorted(block) for block in blocks)
    assert sorted(order) == list(range(50))
    assert order == files.order(0, seed=3, epoch=0).tolist()
    assert order != files.order(0, seed=4, epoch=0).tolist()
    assert files.order(0, seed=3, epoch=0, shuffle=False).tolist() == list(range(50))


def test_each_rank_opens_only_its_partitions_files_and_resume_reads_no_skipped_shard(
    tmp_path: Path,
) -> None:
    directory = ids(tmp_path / "d", 2)
    partition = json.loads((directory / "index.json").read_text())["shards"]
    names = [{s["name"] for s in partition if s["partition"] == p} for p in (0, 1)]
    for world in (2, 4):
        for rank in range(world):
            files = ShardFiles(directory, shuffle_block=2)
            fed = feeder(world, rank)
            for epoch in (0, 1):
                loader = fed.loader(files, None, GLOBAL_BATCH, True, True, seed=3)
                list(fed.epoch(loader, epoch, "", lambda: None))
            assert set(files.opened) <= names[rank // (world // 2)], (world, rank)
            assert max(files.opened.values()) <= 2, "each shard is opened once an epoch at most"
    # Unshuffled, step 3 is samples 18..23 and 42..47: resuming there opens only their shards.
    files = ShardFiles(directory, shuffle_block=2)
    resumed = read(files, 1, shuffle=False, resume_at=(0, 3 * GLOBAL_BATCH))
    assert resumed == [[list(range(18, 24)) + list(range(42, 48))]]
    assert set(files.opened) == {
        "shard-00003.pt",
        "shard-00004.pt",
        "shard-00008.pt",
        "shard-00009.pt",
    }


def test_a_resumed_epoch_equals_the_uninterrupted_one_at_another_world_size(
    tmp_path: Path,
) -> None:
    directory = ids(tmp_path / "d", 2, fmt="npy")
    uninterrupted = global_batches(read(directory, 4, epoch=1))
    for world, workers in ((1, 2), (2, 0)):
        resumed = read(directory, world, epoch=1, resume_at=(1, GLOBAL_BATCH), num_workers=workers)
        assert global_batches(resumed) == uninterrupted[1:], world
    assert read(directory, 2, epoch=0, resume_at=(1, GLOBAL_BATCH)) == [[], []]
    # Evaluation (no drop_last) reads them as a map-style dataset: every sample once.
    evaluated = []
    for rank in (0, 1):
        fed = feeder(2, rank)
        loader = fed.loader(ShardFiles(directory), None, 10, False, False, seed=0)
        evaluated += [i for batch in fed.epoch(loader, 0, "", lambda: None) for i in batch.tolist()]
    assert sorted(evaluated) == list(range(SIZE))
    # The files' own seed wins over the engine's (3 in `read`).
    own = global_batches(read(ShardFiles(directory, seed=5, shuffle_block=2), 1, epoch=1))
    assert own != uninterrupted
    assert own == global_batches(read(ShardFiles(directory, seed=5, shuffle_block=2), 2, epoch=1))


def test_formats_a_decode_hook_and_unequal_partitions(tmp_path: Path) -> None:
    pairs = [(torch.full((2,), float(i)), torch.tensor(i % 3)) for i in range(SIZE + 2)]
    for fmt in ("pt", "npz"):
        files = ShardFiles(write_shards(pairs, tmp_path / fmt, SHARD, 2, fmt))
        assert len(files) == SIZE + 2
        assert_close(files[31], pairs[31])
    # Another format: the user's index and decoder (one JSON list of ids per file), with
    # partitions of 12 and 36 samples: 2 steps of 6 from each, the note says.
    custom = tmp_path / "custom"
    custom.mkdir()
    shards = []
    for k in range(4):
        (custom / f"{k}.json").write_text(json.dumps(list(range(k * 12, k * 12 + 12))))
        shards.append({"name": f"{k}.json", "samples": 12, "partition": min(k, 1)})
    index = {"format": "json", "partitions": 2, "shards": shards}
    (custom / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="names the format 'json'.*pass decode="):
        ShardFiles(custom)
    decoded = ShardFiles(custom, decode=lambda path: torch.tensor(json.loads(path.read_text())))
    said: list[str] = []
    fed = feeder(1, 0)
    fed.say = said.append
    loader = fed.loader(decoded, None, GLOBAL_BATCH, True, True, seed=0)
    assert said[0].endswith(
        "partitions hold 12 to 36 samples and each step takes 6 of each, "
        "so the smallest decides: 2 steps per epoch, 24 samples left out."
    )
    batches = [batch.tolist() for batch in fed.epoch(loader, 0, "", lambda: None)]
    assert sorted(i for batch in batches for i in batch[:6]) == list(range(12))
    assert len(batches) == 2 and all(min(batch[6:]) >= 12 for batch in batches)


def test_what_shard_files_cannot_honour_is_refused_by_name(tmp_path: Path) -> None:
    directory = ids(tmp_path / "d", 2)
    files = ShardFiles(directory)
    with pytest.raises(ConfigError, match="global batch of 9 does not split over the 2 part"):
        feeder(1, 0).loader(files, None, 9, True, True, seed=0)
    with pytest.raises(ConfigError, match="3 data-parallel workers cannot read the 2 partitions"):
        feeder(3, 0).loader(files, None, 12, True, True, seed=0)
    with pytest.raises(ConfigError, match="Partition 0 .* has 24 samples, fewer than its 30"):
        feeder(1, 0).loader(files, None, 60, True, True, seed=0)
    with pytest.raises(SetupError, match="ShardFiles take no sampler"):
        feeder(1, 0).loader(files, None, 12, True, True, seed=0, sampler=range(4))
    # Damage: a shard rewritten, then an index that lists another count, then a lost file.
    (directory / "shard-00002.pt").write_bytes(b"not a shard")
    with pytest.raises(ConfigError, match="shard-00002.pt has 11 bytes but .*index.json rec"):
        feeder(1, 0).loader(ShardFiles(directory), None, 12, True, True, seed=0)
    with pytest.raises(ConfigError, match="shard-00002.pt has 11 bytes but .*index.json rec"):
        ShardFiles(directory)[12]
    # A machine holding only partition 1's files trains its ranks' shares (rank 2 of 4).
    fed = feeder(4, 2)
    loader = fed.loader(ShardFiles(directory), None, 12, True, True, seed=0)
    assert len(list(fed.epoch(loader, 0, "", lambda: None))) == STEPS
    index = json.loads((directory / "index.json").read_text())
    for shard in index["shards"]:
        shard.pop("bytes")
    index["shards"][0]["samples"] = 4
    (directory / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="shard-00000.pt holds 5 samples but .* lists 4"):
        ShardFiles(directory)[0]
    with pytest.raises(ConfigError, match="shard-00002.pt cannot be read .*it is damaged"):
        ShardFiles(directory)[12]
    (directory / "shard-00004.pt").unlink()
    with pytest.raises(ConfigError, match="shard-00004.pt listed in .* is missing; restore"):
        feeder(2, 0).loader(ShardFiles(directory), None, 12, True, True, seed=0)
    with pytest.raises(ConfigError, match="has no index.json; write the shards again"):
        ShardFiles(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    shards = [{"name": "a.pt", "samples": 3, "partition": 1}, {"name": "b.pt", "samples": 3}]
    (bad / "index.json").write_text(json.dumps({"format": "pt", "partitions": 2, "shards": shards}))
    with pytest.raises(ConfigError, match="index.json is not a readable shard index .*partition"):
        ShardFiles(bad)
    shards[1]["partition"] = 0
    (bad / "index.json").write_text(json.dumps({"format": "pt", "partitions": 2, "shards": shards}))
    with pytest.raises(ConfigError, match="must list the shards of partition 0, then 1, ... up"):
        ShardFiles(bad)
    with pytest.raises(ConfigError, match="holds files other than shard files, and writing"):
        ids(tmp_path, 1)
    with pytest.raises(ConfigError, match="48 samples cannot fill 49 partitions; use between"):
        ids(tmp_path / "d", 49)
    assert len(ShardFiles(ids(tmp_path / "d", 1))) == SIZE  # earlier shards are replaced


TRAIN_STEPS = 7  # 4 steps in epoch 0, 3 in epoch 1
SAVED_AT = 5


def train(
    strategy: str,
    directory: str,
    steps: int = TRAIN_STEPS,
    load: str | None = None,
    save: str | None = None,
    workers: int = 0,
    close: bool = True,
) -> dict[str, torch.Tensor] | None:
    """Train a float64 MLP on the shard files in `directory` to step `steps`, from the
    checkpoint `load` if given, saving one at `save` if given; the parameters (main rank)."""
    engine = dtrain.init(strategy=strategy, seed=0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    if load is not None:
        engine.load(load)
    loader = engine.dataloader(
        ShardFiles(directory), global_batch_size=GLOBAL_BATCH, num_workers=workers
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


def at_two_ranks(directory: str, path: str) -> tuple[Any, Any]:
    """Under ddp: uninterrupted, and resumed from the checkpoint at `path`."""
    return train("ddp", directory, close=False), train("ddp", directory, load=path)


def test_persistent_workers_read_a_seed_set_after_they_started(tmp_path: Path) -> None:
    """As after `engine.load` of a checkpoint whose order had another seed."""
    directory = ids(tmp_path / "d", 1)
    fed = feeder(1, 0)
    loader = fed.loader(
        ShardFiles(directory),
        None,
        GLOBAL_BATCH,
        True,
        True,
        seed=3,
        num_workers=1,
        persistent_workers=True,
    )
    assert len(list(fed.epoch(loader, 0, "", lambda: None))) == STEPS
    loader.dataset.seed = 11
    seen = [batch.tolist() for batch in fed.epoch(loader, 1, "", lambda: None)]
    fresh = feeder(1, 0)
    again = fresh.loader(ShardFiles(directory), None, GLOBAL_BATCH, True, True, seed=11)
    assert seen == [batch.tolist() for batch in fresh.epoch(again, 1, "", lambda: None)]


@pytest.mark.parametrize(
    ("format", "samples", "message"),
    [
        ("npz", [torch.arange(3)] * 4, "'npz' stores samples that are a tuple of tensors"),
        ("npz", [{"x": 1}] * 4, "a sample here is a dict; write format='pt'"),
        ("npy", [(torch.ones(2), 1)] * 4, "or npz for \\(input, target\\) pairs"),
        ("npy", [torch.ones(2), torch.ones(3)], "Samples 0 to 1 cannot be stacked into one npy"),
    ],
)
def test_samples_a_format_cannot_hold_are_refused(
    tmp_path: Path, format: str, samples: list, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        write_shards(samples, tmp_path / "d", 2, format=format)
    assert not (tmp_path / "d").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give write_shards a directory"):
        write_shards([torch.ones(2)], tmp_path / "file", 1)


@pytest.mark.timeout(120)
def test_shard_files_train_as_single_and_resume_at_another_world_size(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SIZE, 6, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (SIZE,), generator=generator)
    directory = str(write_shards(list(zip(inputs, targets, strict=True)), tmp_path / "d", 5, 2))
    reference = train("single", directory)
    path = str(tmp_path / "ckpt")
    train("single", directory, SAVED_AT, save=path, workers=2)
    uninterrupted, resumed = run_ranks(at_two_ranks, 2, directory, path)[0]
    assert_close(uninterrupted, reference)
    assert_close(resumed, reference)


@pytest.mark.timeout(240)
def test_the_demo_trains_the_digits_from_shards_the_cli_wrote(tmp_path: Path) -> None:
    assert "--partitions PARTITIONS" in cli_without_torch(tmp_path, "data", "write", "-h").stdout
    shards = str(tmp_path / "shards")
    flags = ("--samples-per-shard", "128", "--partitions", "2")
    written = run_cli("data", "write", "--dataset", "digits", "--out", shards, *flags, cwd=tmp_path)
    assert "the 1437 training samples of digits in 2 partition(s)" in written.stdout
    metrics = demo(tmp_path, "--strategy", "ddp", "--nproc", "2", "--data", shards)
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["steps"] == 12 * (718 // 32)  # partitions of 719 and 718 samples
    share = ShardShare(ShardFiles(shards), 64, 1, 0, True, 0)
    wrong = argparse.Namespace(model="gpt", data=shards)
    with pytest.raises(ConfigError, match=r"shapes \[\(1, 8, 8\), \(\)\], but --model gpt"):
        check_shards(share, load_text()[0], wrong)
    missing = run_cli("demo", "--data", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 2 and "holds no index.json; write shard files" in missing.stderr
