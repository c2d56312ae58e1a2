"""Streams (IterableDatasets) in `engine.dataloader`: each sample once per epoch over every
data-parallel rank and DataLoader worker, in dtrain's global batches, resumable by count.

The epoch's i-th sample of the stream belongs to global batch i // B and to rank
(i % B) // b, where B is the global batch and b = B / dp_size the per-rank one: the
unshuffled map-style rule, so the samples of step t are the same whatever the number of
ranks. A rank's DataLoader worker w (of W) builds that rank's batches w, w + W, ...; the
DataLoader asks its workers in turn and yields their batches in that order, so the rank
trains its batches in stream order. Every reader (one per rank and worker) reads the whole
stream and skips the samples that are not its own, collating only its own.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torch.utils.data._utils import worker as _worker

from dtrain.data.sampler import RankShare
from dtrain.errors import ConfigError, SetupError

_END = object()


def is_stream(dataset: Any) -> bool:
    """True if `dataset` can only be iterated (an IterableDataset, or anything without
    ``__getitem__`` and ``__len__``)."""
    return isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    )


class StreamShare(IterableDataset, RankShare):
    """One data-parallel rank's share of each global batch of `dataset`, as whole batches
    (iterate it with a DataLoader of ``batch_size=None``, which `stream_loader` builds).

    Args:
        dataset: the stream; ``set_epoch(epoch)`` is called on it (in every reader) before
            each epoch if it has one, so that its own per-epoch shuffle follows the epoch.
        batch_size: samples per rank per step (the global batch is batch_size * dp_size).
        dp_size, dp_rank: the data-parallel ranks and this one.
        drop_last: drop the epoch's last incomplete global batch. When False its samples
            go by the same rule: rank r gets those at positions [r*b, (r+1)*b) of it (a
            shorter batch, or none: such a rank has one batch fewer), so every sample is
            seen once.
        collate_fn: makes a batch of a list of samples (torch's default_collate if None).
    """

    shuffle = False
    """dtrain does not reorder a stream (`Feeder.epoch` reads this as it reads a sampler's)."""

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int,
        dp_size: int,
        dp_rank: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        RankShare.__init__(self, batch_size, dp_size, dp_rank)
        self.dataset = dataset
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        # The epoch and the batches to skip, in shared memory: persistent DataLoader
        # workers keep the copy of this object they started with, and must see each epoch.
        self._where = torch.zeros(2, dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return int(self._where[0])

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch; `skip` leaves out its first `skip` global batches (resume): their
        samples are read and dropped, never collated."""
        self._where[0], self._where[1] = epoch, skip
        if hasattr(self.dataset, "set_epoch"):
            # Here too, not only in the readers: a stream whose length follows the epoch
            # gives the main process's len(loader) for it.
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._where.tolist()
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        whole, size = self.global_batch_size, self.batch_size
        before, after = self.dp_rank * size, whole - (self.dp_rank + 1) * size
        samples = _whole(self.dataset)
        if _advance(samples, skip * whole) < skip * whole:
            return  # the stream ended inside the part already trained
        for t in itertools.count(skip):
            mine = (t - skip) % workers == worker
            share: list[Any] = []
            complete = False
            if _advance(samples, before) == before:
                share = list(itertools.islice(samples, size)) if mine else []
                taken = len(share) if mine else _advance(samples, size)
                complete = taken == size and _advance(samples, after) == after
            if share and (complete or not self.drop_last):  # share: this reader's batch
                yield self.collate_fn(share)
            if not complete:  # the stream ended in this global batch
                if t == 0 and self.drop_last:
                    raise _too_small(self.global_batch_size, self.batch_size, self.dp_size)
                return


class SizedStreamShare(StreamShare):
    """A `StreamShare` of a stream that knows its length: it has ``__len__`` (this rank's
    batches per epoch, as `ShardedBatchSampler` counts them), so ``len(loader)``, the
    progress bar's total and evaluation's count of batches work as for a map-style set."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        if self.drop_last and len(dataset) < self.global_batch_size:
            raise _too_small(self.global_batch_size, self.batch_size, self.dp_size, len(dataset))

    def __len__(self) -> int:
        full, rest = divmod(len(self.dataset), self.global_batch_size)  # type: ignore[arg-type]
        has_share = rest > self.dp_rank * self.batch_size
        return full + (0 if self.drop_last or not has_share else 1)


def stream_share(
    dataset: Any,
    batch_size: int,
    dp_size: int,
    dp_rank: int,
    shuffle: bool,
    drop_last: bool,
    collective_forward: bool,
    loader_kwargs: dict[str, Any],
) -> StreamShare:
    """The `StreamShare` `engine.dataloader` iterates for a stream; a ConfigError or
    SetupError, saying what to do, for what a stream cannot honour. The DataLoader's
    `collate_fn` (taken out of `loader_kwargs`) collates each share in the reader."""
    if shuffle:
        raise ConfigError(
            f"dtrain reads a stream ({type(dataset).__name__}) in its own order and cannot "
            "shuffle it; shuffle the stream itself (a seeded buffer shuffle with set_epoch, "
            "as Hugging Face datasets' shuffle(seed=..., buffer_size=...)) and leave out "
            "shuffle or pass shuffle=False."
        )
    refuse_reordering("A stream takes", "the stream's", loader_kwargs)
    sized = hasattr(dataset, "__len__")
    if not (drop_last or sized) and collective_forward and dp_size > 1:
        raise SetupError(
            "This strategy runs each forward on all data-parallel workers together, and a "
            "stream without __len__ cannot tell them ahead how many batches each gets at "
            "the end of the epoch with drop_last=False; give the dataset a __len__, or use "
            "drop_last=True."
        )
    kind = SizedStreamShare if sized else StreamShare
    collate_fn = loader_kwargs.pop("collate_fn", None)
    return kind(dataset, batch_size, dp_size, dp_rank, drop_last, collate_fn)


def refuse_reordering(takes: str, whose: str, loader_kwargs: dict[str, Any]) -> None:
    """A SetupError for a DataLoader option that would reorder what dtrain splits itself
    (a sampler, a batch sampler, in_order=False): `takes` names the data ("A stream
    takes"), `whose` its batches' owner ("the stream's")."""
    for name in ("sampler", "batch_sampler"):
        if loader_kwargs.get(name) is not None:
            raise SetupError(
                f"{takes} no {name}: dtrain gives each worker its share of {whose} global "
                f"batches itself; leave out {name}."
            )
    if loader_kwargs.get("in_order") is False:
        raise SetupError(
            f"in_order=False would let a rank train {whose} batches out of order, so the "
            "ranks of one step would mix different global batches; leave out in_order."
        )


def as_is(batch: Any) -> Any:
    """The DataLoader's collate_fn for a `StreamShare`, whose batches come collated."""
    return batch


def _too_small(
    global_batch: int, batch_size: int, dp_size: int, size: int | None = None
) -> ConfigError:
    """The refusal of a stream (of `size` samples, if known) that fills no global batch."""
    has = "fewer samples" if size is None else f"{size} samples"
    return ConfigError(
        f"The stream has {has} than one global batch of {global_batch} ({batch_size} per "
        f"worker x {dp_size} workers); lower the batch size or use fewer workers."
    )


def _advance(samples: Iterator[Any], count: int) -> int:
    """Read and drop up to `count` samples; how many there were."""
    return sum(1 for _ in itertools.islice(samples, count))


def _whole(dataset: Iterable[Any]) -> Iterator[Any]:
    """Every sample of `dataset`, read as the main process would read it. A stream that
    splits itself over DataLoader workers by `get_worker_info` (Hugging Face datasets,
    WebDataset's split_by_worker, torch's documented pattern) would give each worker only
    part of it, and the global index needs all of it: the worker info is hidden while the
    stream runs."""
    with _no_worker_info():
        iterator = iter(dataset)
    while True:
        with _no_worker_info():
            sample = next(iterator, _END)
        if sample is _END:
            return
        yield sample


@contextlib.contextmanager
def _no_worker_info() -> Iterator[None]:
    """`torch.utils.data.get_worker_info()` returns None inside (torch keeps it in this
    module variable)."""
    saved, _worker._worker_info = _worker._worker_info, None
    try:
        yield
    finally:
        _worker._worker_info = saved
