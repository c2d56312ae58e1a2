"""`engine.dataloader`'s loader: a DataLoader whose passes are epochs and which, after a
load, resumes by itself, whatever loop reads it.

A pass over it (``for batch in loader``, ``iter`` and ``next``, ``enumerate(loader)``,
`engine.progress`) reads one epoch of this worker's share: the one `set_epoch` (or
``progress``'s ``epoch=``) chose, else the next one it counts (0, 1, ...). A training pass
read to its end moves the count on, as a loop that calls a DistributedSampler's
``set_epoch`` each epoch would; one broken off leaves it, so the next pass reads that
epoch again from its start, as a new pass over torch's loaders does.

A training pass is one of a training loader (drop_last) that starts with gradients on, or
any pass of `engine.progress`. It records the batches it yields, and each optimizer step
moves the run's `Position` past the batches it trained (not those read ahead: see
`dtrain.step.position`), so a checkpoint records where a plain loop stands as well as
``progress``'s. An evaluation's
pass (`engine.evaluate` and ``torch.no_grad()`` loops turn gradients off; an evaluation
loader without drop_last) reads its epoch whole and leaves the position and the count
alone, even over the training loader in the middle of its epoch.

After a load, the first training pass takes the checkpoint's resume point, once (so that
no later pass, and no ``progress`` around the pass, skips again): a pass following the
count goes on in the checkpoint's epoch, after the samples it had trained, with its
shuffle seed; a chosen epoch reads nothing of an epoch before the checkpoint's, the rest
of the checkpoint's epoch, or a later epoch whole. A loop over epochs therefore starts at
``engine.epoch`` (or chooses each epoch, and reads nothing of the finished ones).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from dtrain.data.sampler import ShardedBatchSampler
from dtrain.data.streams import StreamShare
from dtrain.errors import SetupError
from dtrain.step.position import Position, TrainingPass

Share = ShardedBatchSampler | StreamShare
"""This worker's share of each global batch: the batch sampler of a map-style dataset, or
the dataset itself for a stream or shard files."""


class ResumableLoader(DataLoader):
    """A DataLoader over one worker's `share`, reading one epoch per pass (see the module).

    Args:
        dataset, loader_kwargs: as for DataLoader (the share is in them).
        share: sets each pass's epoch and the batches it leaves out.
        position: where training stands; its training passes count the batches they
            yield, the steps those they train; read after a load.
        training: a training loader (drop_last), whose passes with gradients on train.
    """

    def __init__(
        self,
        dataset: Any,
        share: Share,
        position: Position,
        training: bool,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **loader_kwargs)
        self.share = share
        self.position = position
        self.training = training
        self._next_epoch = 0
        """The epoch a pass that chooses none reads."""
        self._chosen: int | None = None
        """The epoch `set_epoch` chose for the next pass."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read `epoch` (its shuffle; after a load, nothing of an epoch
        the checkpoint had finished, the rest of the one it stopped in), as
        ``engine.progress(loader, epoch)`` does."""
        self._chosen = epoch

    def __iter__(self) -> Iterator[Any]:
        # A generator: the pass starts at its first batch, inside the loop that reads it
        # (engine.evaluate turns gradients off there, not where it calls iter).
        begun = self.begin()
        if begun is not None:
            yield from begun[0]

    def begin(
        self, epoch: int | None = None, tracked: bool = False
    ) -> tuple[Iterator[Any], int] | None:
        """Start a pass: over `epoch` if given, else the one `set_epoch` chose, else the
        next one counted. Returns the pass's batches and how many of the epoch's first
        batches it leaves out (trained before the checkpoint loaded); None if the
        checkpoint had trained all of a chosen epoch. `tracked`: a training pass whatever
        the loader and the gradients (``engine.progress``'s)."""
        chosen = self._chosen if epoch is None else epoch
        self._chosen = None
        epoch = self._next_epoch if chosen is None else chosen
        if not (tracked or (self.training and torch.is_grad_enabled())):
            self.share.set_epoch(epoch)
            return super().__iter__(), 0
        reader = object()  # this pass, as the resume point knows it
        where, share = self.position, self.share
        loaded = where.resume_at is not None
        start = where.take_resume(epoch, chosen is not None, reader)
        if start is None:
            self._next_epoch = epoch + 1
            return None
        if loaded and share.shuffle and where.shuffle_seed is not None:
            share.seed = where.shuffle_seed  # the checkpoint's order, skipped below
        epoch, trained = start
        skip = trained // share.global_batch_size
        self._refuse_a_replayed_epoch(skip)
        self._next_epoch = epoch  # until the pass reads to its end
        # Before the DataLoader's iterator starts: its workers read it when they start.
        share.set_epoch(epoch, skip)
        return self._train(epoch, skip, reader), skip

    def _refuse_a_replayed_epoch(self, skip: int) -> None:
        """A SetupError if the checkpoint had trained more batches of its epoch than the
        epoch holds: steps went on after the pass read its last batch."""
        try:
            length = len(self.share)
        except TypeError:  # a stream that does not know its length
            return
        if skip > length:
            raise SetupError(
                f"The checkpoint had trained {skip} batches of an epoch of {length}: its "
                "steps trained batches its pass over the training loader never read, as "
                "when the loader is wrapped in itertools.cycle (which replays its first "
                "epoch, cached, instead of reading the next). Do not wrap the loader in "
                "itertools.cycle; loop over epochs instead (while engine.step < steps: "
                "for batch in loader: ...), each pass reading the next epoch."
            )

    def _train(self, epoch: int, skip: int, reader: object) -> Iterator[Any]:
        """The batches of a training pass over `epoch` after its first `skip`, each
        counted as read (the steps count them trained); once they are all read, the
        count moves on."""
        where, share = self.position, self.share
        seed = share.seed if share.shuffle else None
        counted = TrainingPass(epoch, share.global_batch_size, seed, skip, skip)
        for batch in super().__iter__():
            counted.read += 1
            where.read(counted)
            yield batch
        where.finished(reader)
        self._next_epoch = epoch + 1
