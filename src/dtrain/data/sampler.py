"""Sharded loading: every step draws one global batch, split over the data-parallel ranks.

Each epoch has one shuffle, the same on every rank (seeded by seed and epoch). Global
batch t is the slice ``perm[t*B:(t+1)*B]``; rank r reads the r-th contiguous share of it.
So for a fixed global batch B, the samples of step t are the same whatever the number of
workers, and the ranks' shares, concatenated in rank order, are the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler

from dtrain.errors import ConfigError, SetupError


class RankShare:
    """What every reader of dtrain's knows: this rank's `batch_size` samples of each
    global batch of `dp_size` ranks' shares, and which rank it is (`dp_rank`)."""

    def __init__(self, batch_size: int, dp_size: int, dp_rank: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"The batch size per worker must be at least 1, got {batch_size}.")
        self.batch_size = batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by one step over all data-parallel ranks."""
        return self.batch_size * self.dp_size


class ShardedBatchSampler(Sampler[list[int]], RankShare):
    """Yields this rank's share of each global batch, as lists of dataset indices.

    Args:
        dataset_size: number of samples.
        batch_size: samples per rank per step (the global batch is batch_size * dp_size).
        dp_size: data-parallel ranks.
        dp_rank: this rank.
        shuffle: reshuffle every epoch (one permutation shared by all ranks).
        seed: base seed of the shuffle.
        drop_last: drop an epoch's last, incomplete global batch (default for training,
            so that every step sees a full global batch whatever the world size). When
            False (for evaluation) the last global batch is split as evenly as possible,
            and a rank whose share is empty has one batch fewer; every sample is seen
            exactly once.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        RankShare.__init__(self, batch_size, dp_size, dp_rank)
        self.dataset_size = dataset_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.skip = 0
        if drop_last and dataset_size < self.global_batch_size:
            raise ConfigError(
                f"The data set has {dataset_size} samples, fewer than one global batch of "
                f"{self.global_batch_size} ({batch_size} per worker x {dp_size} workers); "
                "lower the batch size or use fewer workers."
            )

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's shuffle; `skip` leaves out its first `skip` batches (resume)."""
        self.epoch = epoch
        self.skip = skip

    def __len__(self) -> int:
        full, rest = divmod(self.dataset_size, self.global_batch_size)
        has_share = rest > self.dp_rank  # tensor_split gives the first `rest` ranks a sample
        return full + (0 if self.drop_last or not has_share else 1)

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        # torch takes seeds below 2**64, and a run's seed may be any of them
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)
        return torch.randperm(self.dataset_size, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order().tolist()  # one conversion per epoch, not one per batch
        start, self.skip = self.skip, 0
        epoch = self.epoch
        for t in range(start, len(self)):
            global_batch = order[t * self.global_batch_size : (t + 1) * self.global_batch_size]
            yield _share(global_batch, self.dp_size, self.dp_rank)
        # A loader iterated again without set_epoch moves on to the next shuffle.
        if self.epoch == epoch:
            self.epoch = epoch + 1


def _share(batch: list[int], parts: int, index: int) -> list[int]:
    """Part `index` of `batch` cut into `parts` near-equal runs, the first ones one longer
    when it does not divide (as `torch.tensor_split` cuts)."""
    size, rest = divmod(len(batch), parts)
    start = index * size + min(index, rest)
    return batch[start : start + size + (1 if index < rest else 0)]


def per_worker_batch(batch_size: int | None, global_batch_size: int | None, dp_size: int) -> int:
    """The per-worker batch from exactly one of the two ways to give it; a SetupError if
    both or neither are given, or if the global batch does not split over `dp_size`."""
    if (batch_size is None) == (global_batch_size is None):
        raise SetupError(
            "engine.dataloader needs one of batch_size (per worker) or global_batch_size "
            "(over all workers); pass exactly one."
        )
    if global_batch_size is None:
        assert batch_size is not None
        return batch_size
    if global_batch_size % dp_size or global_batch_size < dp_size:
        raise SetupError(
            f"A global batch of {global_batch_size} does not split evenly over {dp_size} "
            f"data-parallel workers; use a multiple of {dp_size} (or change the number of "
            "processes)."
        )
    return global_batch_size // dp_size


def unsharded_warning(loader: Any, dp_size: int) -> str | None:
    """A warning if `dp_size` > 1 workers iterating `loader` would each read every sample
    (neither a ShardedBatchSampler nor a DistributedSampler); None if it is sharded."""
    sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(sampler, "sampler", None)
    if dp_size == 1 or isinstance(sampler, ShardedBatchSampler):
        return None
    if isinstance(inner, DistributedSampler):
        return None
    return (
        f"dtrain: warning: this loader is not sharded, so each of the {dp_size} data-parallel "
        "workers reads every sample; build it with engine.dataloader (or a "
        "DistributedSampler) so that each reads its own share."
    )
