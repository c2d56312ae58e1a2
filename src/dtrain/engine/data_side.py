"""The Engine's data side: loaders that give each data-parallel worker its share of every
global batch (of a map-style dataset here, of a stream in `dtrain.data.streams`, of shard files
in `dtrain.data.shard_files`) and resume mid-epoch after a load whatever loop reads them
(`dtrain.data.resumable`), and the epochs `engine.progress` iterates with a progress bar."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dtrain.config import Config
from dtrain.data.resumable import ResumableLoader, Share
from dtrain.data.sampler import ShardedBatchSampler, per_worker_batch, unsharded_warning
from dtrain.data.shard_files import ShardFiles
from dtrain.data.shard_share import shard_share
from dtrain.data.streams import StreamShare, as_is, is_stream, stream_share
from dtrain.observe.events import Observer
from dtrain.observe.loss_reads import LossReads
from dtrain.observe.progress import Throughput, track
from dtrain.observe.timing import RunTiming
from dtrain.process.logs import LOGGER
from dtrain.process.rng import drawn_seed
from dtrain.process.topology import Topology
from dtrain.step.position import Position
from dtrain.strategies.base import Strategy


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
    ) -> ResumableLoader:
        """A DataLoader over this worker's share of each global batch, which resumes after
        a load (see `Engine.dataloader`); `collective_forward`: the strategy's forward is a
        collective over the data-parallel workers."""
        batch_size = per_worker_batch(batch_size, global_batch_size, self.dp_size)
        share: Share
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
            return ResumableLoader(
                share,
                share,
                self.position,
                drop_last,
                batch_size=None,
                collate_fn=as_is,
                **loader_kwargs,
            )
        return ResumableLoader(
            dataset, share, self.position, drop_last, batch_sampler=share, **loader_kwargs
        )

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
        `loss()`. An `engine.dataloader` loader selects the epoch's shuffle and, after a
        load, skips what the checkpoint had already trained (whole epochs, then the batches
        of the epoch it stopped in: `ResumableLoader.begin`); another loader can only skip
        whole epochs. `waited` is told each wait for a batch, `finish` called after the
        last (see `track`)."""
        batches: Iterable[Any]
        if isinstance(loader, ResumableLoader):
            begun = loader.begin(epoch, tracked=True)
            if begun is None:
                return
            batches, skip = begun
            per_step = loader.share.global_batch_size
        else:
            self._warn_if_unsharded(loader)
            if self.position.take_resume(epoch, chosen=True) is None:
                return
            batches, skip = loader, 0
            per_step = (loader.batch_size or 0) * self.dp_size
            self.position.enter(epoch, per_step, self.position.shuffle_seed)
        yield from track(
            batches,
            total=None if (length := _length(loader)) is None else length - skip,
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
    ) -> ResumableLoader:
        """A loader giving this worker its share of each global batch, one epoch per pass,
        which resumes by itself after `load` or `resume`, whatever loop reads it.

        Each pass (``for batch in loader``, ``iter``/``next``, `progress`) reads the next
        epoch, with that epoch's shuffle; ``loader.set_epoch(epoch)`` or
        ``progress(loader, epoch)`` chooses it instead. A training loader (drop_last)
        records where it stands for `save`; after a load its next pass continues the
        checkpoint's epoch after the samples it had trained, whether it was made before
        or after the load (loop over epochs from `engine.epoch`; a chosen epoch the
        checkpoint had finished reads nothing). See `dtrain.data.resumable`.

        Args:
            dataset: a map-style dataset of (input, target) samples, or a stream (an
                IterableDataset): its i-th sample of an epoch goes to global batch i // B
                and to worker (i % B) // b (b = B / dp_size); each worker, and each of its
                DataLoader workers, reads the whole stream and keeps its own batches, so
                every sample is trained once, whatever the number of workers (see
                `dtrain.data.streams`). Or a `dtrain.ShardFiles`: shard files in P partitions,
                global batch t taking B/P samples of each partition's seeded order, so that
                a worker opens only the files of its own partitions (see
                `dtrain.data.shard_files`).
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
        already trained (whole epochs, then the batches of the epoch it stopped in; the
        loader does, once, so a plain pass over it after this one skips nothing again).
        The loader's workers and pinning feed the end-of-run advice on a data-bound step.
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


class TrainedSamples(Observer):
    """Counts each optimizer step in the position and moves the data position by what the
    step trained (`Position.stepped`); the first of the Engine's observers, so that
    whatever another one does at that step (a checkpoint) sees the position after it."""

    def __init__(self, position: Position) -> None:
        self.position = position
        self._in_train_step = False
        """A step of `engine.train_step` runs: it trains one batch of the loader."""

    def on_step_start(self, step: int) -> None:
        self._in_train_step = True

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        self._in_train_step = False

    def on_optimizer_end(self, step: int) -> None:
        self.position.stepped(step, one_batch=self._in_train_step)
