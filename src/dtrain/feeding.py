"""The Engine's data side: loaders that give each data-parallel worker its share of every
global batch, and the epochs it iterates with a progress bar, resuming mid-epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from dtrain.data import ShardedBatchSampler, per_worker_batch, unsharded_warning
from dtrain.errors import SetupError
from dtrain.observe.logs import LOGGER
from dtrain.observe.progress import Throughput, track
from dtrain.position import Position


class Feeder:
    """Loaders and epochs for one data-parallel worker.

    Args:
        dp_size, dp_rank: the data-parallel workers and this one's index among them.
        device: where batches go (pinned host memory when it is a GPU).
        position: where training stands (epoch, samples; a resume point after a load).
        throughput: samples and seconds, counted by the progress bar.
        say: prints a line on the main rank.
        is_main: the rank that shows the progress bar.
    """

    def __init__(
        self,
        dp_size: int,
        dp_rank: int,
        device: torch.device,
        position: Position,
        throughput: Throughput,
        say: Callable[[str], None],
        is_main: bool,
    ) -> None:
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.device = device
        self.position = position
        self.throughput = throughput
        self.say = say
        self.is_main = is_main
        self._told_batch = False
        self._warned_unsharded = False

    def loader(
        self,
        dataset: Dataset,
        batch_size: int | None,
        global_batch_size: int | None,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A DataLoader over this worker's share of each global batch (see
        `Engine.dataloader`)."""
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise SetupError(
                f"engine.dataloader shards map-style datasets (with __len__ and "
                f"__getitem__), and {type(dataset).__name__} is a stream. Shard the stream "
                "yourself, each worker reading every engine.dp_size-th batch from offset "
                "engine.strategy.dp_rank (e.g. itertools.islice), and iterate a plain "
                "DataLoader of per-worker batches; or index the data as a map-style Dataset."
            )
        batch_size = per_worker_batch(batch_size, global_batch_size, self.dp_size)
        sampler = ShardedBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            self.dp_size,
            self.dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        # Evaluation loaders, and training loaders after the first, go unannounced.
        if drop_last and not self._told_batch:
            self._told_batch = True
            self.say(
                f"dtrain: global batch {batch_size * self.dp_size} ({batch_size} per "
                f"data-parallel worker x {self.dp_size})."
            )
        loader_kwargs.setdefault("pin_memory", self.device.type == "cuda")
        return DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)

    def epoch(
        self,
        loader: DataLoader,
        epoch: int,
        desc: str,
        loss: Callable[[], float | None],
        waited: Callable[[float, float], None] | None = None,
        finish: Callable[[], object] | None = None,
    ) -> Iterator[Any]:
        """The batches of `epoch` that are still to train, with a progress bar showing
        `loss()`; selects the epoch's shuffle and, after a load, skips what the checkpoint
        had already trained (whole epochs, then the batches of the epoch it stopped in).
        `waited` is told each wait for a batch, `finish` called after the last (see
        `track`)."""
        sampler = loader.batch_sampler
        sharded = isinstance(sampler, ShardedBatchSampler)
        self._warn_if_unsharded(loader)
        skip = 0
        where = self.position
        if where.resume_at is not None:
            resume_epoch, resume_samples = where.resume_at
            if epoch < resume_epoch:
                return
            if sharded and sampler.shuffle and where.shuffle_seed is not None:
                sampler.seed = where.shuffle_seed  # the checkpoint's order, skipped below
            if epoch == resume_epoch and sharded:
                skip = resume_samples // sampler.global_batch_size
            where.resume_at = None
        per_step = (loader.batch_size or 0) * self.dp_size
        if sharded:
            sampler.set_epoch(epoch, skip=skip)
            per_step = sampler.global_batch_size
            where.shuffle_seed = sampler.seed if sampler.shuffle else None
        where.epoch = epoch
        where.samples_in_epoch = skip * per_step
        where.samples_per_step = per_step
        yield from track(
            loader,
            total=len(loader) - skip,
            samples_per_item=per_step,
            throughput=self.throughput,
            loss=loss,
            desc=desc,
            enabled=self.is_main,
            waited=waited,
            finish=finish,
        )

    def _warn_if_unsharded(self, loader: Any) -> None:
        """Warn once if the data-parallel workers would all read every sample."""
        if self._warned_unsharded or (message := unsharded_warning(loader, self.dp_size)) is None:
            return
        self._warned_unsharded = True
        LOGGER.warning(message)
        self.say(message)
