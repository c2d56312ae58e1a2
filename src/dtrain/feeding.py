"""The Engine's data side: loaders that give each data-parallel worker its share of every
global batch (of a map-style dataset here, of a stream in `dtrain.streams`, of shard files
in `dtrain.shard_files`), and the epochs it iterates with a progress bar, resuming
mid-epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dtrain.config import Config
from dtrain.data import ShardedBatchSampler, per_worker_batch, unsharded_warning
from dtrain.observe.logs import LOGGER
from dtrain.observe.loss_reads import LossReads
from dtrain.observe.progress import Throughput, track
from dtrain.observe.timing import RunTiming
from dtrain.position import Position
from dtrain.rng import drawn_seed
from dtrain.shard_files import ShardFiles
from dtrain.shard_share import shard_share
from dtrain.strategies.base import Strategy
from dtrain.streams import StreamShare, as_is, is_stream, stream_share
from dtrain.topology import Topology


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
        collective_forward: bool = False,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A DataLoader over this worker's share of each global batch (see
        `Engine.dataloader`); `collective_forward`: the strategy's forward is a collective
        over the data-parallel workers."""
        batch_size = per_worker_batch(batch_size, global_batch_size, self.dp_size)
        share: ShardedBatchSampler | StreamShare
        if isinstance(dataset, ShardFiles) and drop_last:
            # Evaluation (no drop_last) reads them as the map-style dataset they also are.
            share = shard_share(
                dataset, batch_size, self.dp_size, self.dp_rank, shuffle, seed, loader_kwargs
            )
            if (note := share.note()) is not None:
                self.say(note)
        elif is_stream(dataset):
            share = stream_share(
                dataset,
                batch_size,
                self.dp_size,
                self.dp_rank,
                shuffle,
                drop_last,
                collective_forward,
                loader_kwargs,
            )
        else:
            share = ShardedBatchSampler(
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
        loader_kwargs = loader_defaults(loader_kwargs, self.device)
        if isinstance(share, StreamShare):
            # Each reader yields whole collated batches of its own.
            return DataLoader(share, batch_size=None, collate_fn=as_is, **loader_kwargs)
        return DataLoader(dataset, batch_sampler=share, **loader_kwargs)

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
        if isinstance(loader.dataset, StreamShare):
            sampler = loader.dataset
        sharded = isinstance(sampler, (ShardedBatchSampler, StreamShare))
        if not sharded:
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
        try:
            yield from track(
                loader,
                total=None if (batches := _length(loader)) is None else batches - skip,
                samples_per_item=per_step,
                throughput=self.throughput,
                loss=loss,
                desc=desc,
                enabled=self.is_main,
                waited=waited,
                finish=finish,
            )
        finally:
            if skip and isinstance(sampler, StreamShare):
                # The readers read the skip when they start; a later pass over the loader
                # (outside progress) reads the whole epoch, as a sampler's would.
                sampler.set_epoch(epoch)

    def _warn_if_unsharded(self, loader: Any) -> None:
        """Warn once if the data-parallel workers would all read every sample."""
        if self._warned_unsharded or (message := unsharded_warning(loader, self.dp_size)) is None:
            return
        self._warned_unsharded = True
        LOGGER.warning(message)
        self.say(message)


class DataSide:
    """The Engine's data methods (a base class of the Engine, which sets the attributes
    below): loaders of each worker's share, and epochs with a progress bar."""

    config: Config
    topology: Topology
    strategy: Strategy
    timing: RunTiming
    _feeder: Feeder
    _loss: LossReads

    def dataloader(
        self,
        dataset: Dataset,
        batch_size: int | None = None,
        shuffle: bool | None = None,
        drop_last: bool = True,
        *,
        global_batch_size: int | None = None,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A loader giving this worker its share of each global batch.

        Args:
            dataset: a map-style dataset of (input, target) samples, or a stream (an
                IterableDataset): its i-th sample of an epoch goes to global batch i // B
                and to worker (i % B) // b (b = B / dp_size); each worker, and each of its
                DataLoader workers, reads the whole stream and keeps its own batches, so
                every sample is trained once, whatever the number of workers (see
                `dtrain.streams`). Or a `dtrain.ShardFiles`: shard files in P partitions,
                global batch t taking B/P samples of each partition's seeded order, so that
                a worker opens only the files of its own partitions (see
                `dtrain.shard_files`). After `load`, `progress` skips the trained samples.
            batch_size: samples per worker per step; the global batch is this times
                `engine.dp_size`.
            global_batch_size: instead of `batch_size`, the samples of one step over all
                workers (it must divide evenly over `engine.dp_size`).
            shuffle: one shuffle per epoch, shared by all workers, seeded by ``--seed``;
                without one, by a seed drawn from torch's generator now (rank 0's draw: a
                collective over the training processes), so that a script seeded before
                this call shuffles alike in every run, as with ``DataLoader(shuffle=True)``.
                Default: True for a map-style dataset; a stream is read in its own order
                (shuffle=True on one is refused: shuffle the stream itself, by epoch).
            drop_last: drop the epoch's last incomplete global batch (keep True for
                training; use False for evaluation, where every sample is seen once and a
                worker without a share of the last batch has one batch fewer).
            loader_kwargs: passed to `torch.utils.data.DataLoader` (num_workers, ...).
        """
        placement = self.strategy.placement
        if shuffle is None:
            shuffle = not is_stream(dataset)
        seed = self.config.seed
        if seed is None:
            seed = drawn_seed(placement.train_group) if shuffle else 0
        return self._feeder.loader(
            dataset,
            batch_size,
            global_batch_size,
            shuffle,
            drop_last,
            seed,
            placement.collective_forward,
            **loader_kwargs,
        )

    def progress(
        self, loader: DataLoader, epoch: int = 0, desc: str | None = None
    ) -> Iterator[Any]:
        """Iterate `loader` for `epoch`, with a progress bar on the main rank.

        Selects the epoch's shuffle, and after `load` skips what the checkpoint had
        already trained (whole epochs, then the batches of the epoch it stopped in). The
        loader's workers and pinning feed the end-of-run advice on a data-bound step.
        """
        self.timing.reads_from(loader, self.topology.local_world_size)
        yield from self._feeder.epoch(
            loader,
            epoch,
            desc or f"epoch {epoch}",
            loss=lambda: self._loss.last,
            waited=self.timing.timer.data_wait,
            # the epoch's last steps, read before anything is saved and the bar closes
            finish=self._loss.flush,
        )


def loader_defaults(loader_kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """`loader_kwargs` with dtrain's defaults for the DataLoader options left out.

    Batches bound for a GPU come from pinned host memory (``pin_memory=True``), so that
    their copies overlap compute; on the CPU pinning would only cost. The rest are torch's:
    ``num_workers=0`` reads in the training process, because worker processes change what
    a script sees (each holds its own copy of the dataset, which must be picklable under
    spawn; random draws in ``__getitem__`` come from the workers' generators, not the
    training process's); ``persistent_workers=False``, because persistent workers keep
    the dataset as they first copied it, and a dataset changed between epochs (an
    epoch's augmentation set on it) would silently not change for them; and two batches
    prefetched per worker. The end-of-run diagnosis says how many workers a data-bound
    run needs.
    """
    return {"pin_memory": device.type == "cuda", **loader_kwargs}


def _length(loader: DataLoader) -> int | None:
    """Batches per epoch of `loader`; None for a stream that does not know its length."""
    try:
        return len(loader)
    except TypeError:
        return None
