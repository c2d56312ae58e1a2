"""Shard files split over the data-parallel ranks: each rank's `ShardShare` yields its
share of every global batch, opening only the files that hold it (the global order is
described in `dtrain.data.shard_files`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import get_worker_info

from dtrain.data.shard_files import ShardFiles
from dtrain.data.streams import StreamShare, refuse_reordering
from dtrain.errors import ConfigError


class ShardShare(StreamShare):
    """One data-parallel rank's share of each global batch of a `ShardFiles`, as whole
    collated batches (iterated like a `StreamShare`: DataLoader worker w of W builds the
    rank's batches w, w + W, ... of the epoch; resume starts at step `skip` directly).

    Args:
        files: the shard files.
        batch_size, dp_size, dp_rank: as for `StreamShare`.
        shuffle: the epoch's order is shuffled (see `ShardFiles.order`).
        seed: the order's seed (the files' own if they have one).
        collate_fn: makes a batch of a list of samples.
    """

    def __init__(
        self,
        files: ShardFiles,
        batch_size: int,
        dp_size: int,
        dp_rank: int,
        shuffle: bool,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(files, batch_size, dp_size, dp_rank, True, collate_fn)
        self.files = files
        self.shuffle = shuffle
        # In shared memory, as the epoch is: a load after persistent DataLoader workers
        # started sets the checkpoint's seed, and they must read it.
        self._seed = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.seed = seed if files.seed is None else files.seed
        parts = files.partitions
        _check_partitions(files, self.global_batch_size, dp_size)
        self.part = self.global_batch_size // parts
        """Samples each partition gives one step."""
        self.pieces = _runs(dp_rank * batch_size, (dp_rank + 1) * batch_size, self.part)
        """(partition, first, end) of each run of this rank's share, within the partition's
        part of a global batch."""
        files.keep_open = files.shuffle_block * len(self.pieces)
        for p, _, _ in self.pieces:
            files.check_files(p)
        sizes = [files.partition_size(p) for p in range(parts)]
        self.steps = min(sizes) // self.part
        if self.steps == 0:
            raise ConfigError(
                f"Partition {sizes.index(min(sizes))} of {files.directory} has {min(sizes)} "
                f"samples, fewer than its {self.part} of one global batch of "
                f"{self.global_batch_size}; lower the batch size, or write the shards in "
                "fewer partitions."
            )
        self.sizes = sizes
        self.dropped = sum(sizes) - self.steps * self.global_batch_size
        """Samples of an epoch no step takes."""

    @property
    def seed(self) -> int:
        """The order's seed (any of torch's seeds, in [0, 2**64))."""
        high, low = self._seed.tolist()
        return high << 32 | low

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed[0], self._seed[1] = value >> 32, value & 0xFFFFFFFF

    def __len__(self) -> int:
        return self.steps

    def example(self) -> Any:
        """The first sample of this rank's first partition: one to check against the model
        without opening another machine's files."""
        partition = self.pieces[0][0]
        return self.files[self.files.starts[self.files.of_partition[partition][0]]]

    def note(self) -> str | None:
        """The line telling that unequal partitions leave more samples out of each epoch
        than its last incomplete global batch, if they do."""
        if self.dropped <= sum(self.sizes) % self.global_batch_size:
            return None
        return (
            f"dtrain: {self.files.directory}: its partitions hold {min(self.sizes)} to "
            f"{max(self.sizes)} samples and each step takes {self.part} of each, so the "
            f"smallest decides: {self.steps} steps per epoch, {self.dropped} samples left out."
        )

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._where.tolist()
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        orders = {p: self.files.order(p, self.seed, epoch, self.shuffle) for p, _, _ in self.pieces}
        for t in range(skip + worker, self.steps, workers):
            at = t * self.part
            ids = [i for p, lo, hi in self.pieces for i in orders[p][at + lo : at + hi].tolist()]
            yield self.collate_fn([self.files[i] for i in ids])


def shard_share(
    files: ShardFiles,
    batch_size: int,
    dp_size: int,
    dp_rank: int,
    shuffle: bool,
    seed: int,
    loader_kwargs: dict[str, Any],
) -> ShardShare:
    """The `ShardShare` `engine.dataloader` iterates for `files` (training: drop_last); a
    SetupError for a loader option that would reorder it. The DataLoader's `collate_fn`
    (taken out of `loader_kwargs`) collates each share in the reader."""
    refuse_reordering("ShardFiles take", "the shard files'", loader_kwargs)
    collate_fn = loader_kwargs.pop("collate_fn", None)
    return ShardShare(files, batch_size, dp_size, dp_rank, shuffle, seed, collate_fn)


def _runs(start: int, end: int, part: int) -> list[tuple[int, int, int]]:
    """The positions [start, end) of a global batch made of one part of `part` samples per
    partition, as (partition, first, end) runs within each partition's part."""
    return [
        (p, max(start - p * part, 0), min(end - p * part, part))
        for p in range(start // part, (end - 1) // part + 1)
    ]


def _check_partitions(files: ShardFiles, global_batch: int, dp_size: int) -> None:
    """A ConfigError if the global batch or the data-parallel ranks do not fit the
    partitions: each step takes the same share of every partition, and each rank whole
    partitions or a part of one."""
    parts = files.partitions
    if global_batch % parts:
        raise ConfigError(
            f"A global batch of {global_batch} does not split over the {parts} partitions of "
            f"{files.directory} (each step takes as many samples from each); use a multiple "
            f"of {parts}."
        )
    if dp_size % parts and parts % dp_size:
        raise ConfigError(
            f"{dp_size} data-parallel workers cannot read the {parts} partitions of "
            f"{files.directory}: the workers must be a multiple or a divisor of the "
            f"partitions, so that each reads whole partitions or a part of one; run a "
            f"multiple or divisor of {parts} workers, or write the shards again with "
            f"{dp_size} partitions."
        )
