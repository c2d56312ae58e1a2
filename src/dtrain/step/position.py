"""Where training stands: the counters a checkpoint restores besides the states.

The data position counts the samples TRAINED, not those read: a training pass records the
batches it yields (`TrainingPass`), and each optimizer step commits the batches it trained
from the pass it trains from. So a batch read ahead (a prefetcher one batch ahead, a
background thread) is not yet trained, and a pass that trains no step (a validation pass
read with gradients on, in this thread or another) leaves the position as it found it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.errors import SetupError


@dataclass
class Position:
    """The run's optimizer steps and data position, shared by the Engine (which counts
    steps and commits the batches they trained), the training loader (whose passes count
    the batches they read, `dtrain.data.resumable`) and its checkpoints (which save and
    restore them). Its fields are written by its own methods only; the others read them."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """The epoch training is in: the training loader's pass (or `engine.progress`'s)."""
    samples_in_epoch: int = 0
    """Samples of the current epoch already trained."""
    samples_per_step: int = 0
    """The global batch of the current loader."""
    shuffle_seed: int | None = None
    """The shuffle seed of the training loader (None: not shuffled). A checkpoint keeps it
    and a load restores it, and the loader's next pass shuffles with it: the samples it
    skips are those the checkpoint had trained, even where the loader drew another seed
    (made after the load, or in a run whose script seeds nothing)."""
    resume_at: tuple[int, int] | None = None
    """(epoch, samples) a loaded checkpoint had trained; the next training pass (a plain
    loop's or `engine.progress`'s) skips them (`take_resume`)."""
    _trains: TrainingPass | None = field(default=None, repr=False)
    """The pass the steps train from."""
    _newest: TrainingPass | None = field(default=None, repr=False)
    """The training pass that yielded a batch last since the previous step (None: none)."""
    _taken: tuple[object, int] | None = field(default=None, repr=False)
    """The pass that took the resume point and the step count then, until it trained a
    batch or read to its end."""

    def take_resume(
        self, epoch: int, chosen: bool, reader: object | None = None
    ) -> tuple[int, int] | None:
        """Where a training pass (`reader`) starts: (its epoch, the samples of it already
        trained); `epoch` from its start when no load is pending.

        After a load, a pass whose epoch was `chosen` (`engine.progress`'s, the loader's
        `set_epoch`) reads nothing of an epoch before the checkpoint's (None: the resume
        point waits for a later epoch), the rest of the checkpoint's epoch, or a later
        epoch whole; a pass that follows its loader's own count goes on in the
        checkpoint's epoch. The resume point is taken once, so no second pass skips again;
        a SetupError if a pass starts training while the one that took it has trained
        nothing (that pass would start its epoch from the beginning).
        """
        if self.resume_at is None:
            self._refuse_a_second_reader(reader)
            return epoch, 0
        resume_epoch, trained = self.resume_at
        if chosen and epoch < resume_epoch:
            return None
        self.resume_at = None
        self._trains = None  # a pass read before the load trains nothing after it
        self._taken = None if reader is None else (reader, self.step)
        if chosen and epoch > resume_epoch:
            return epoch, 0
        return resume_epoch, trained

    def _refuse_a_second_reader(self, reader: object | None) -> None:
        if self._taken is None or self._taken[0] is reader:
            return
        _, step = self._taken
        self._taken = None
        if self.step == step:
            raise SetupError(
                "After the load, a pass over the training loader took the checkpoint's "
                "data position, but another pass started training before any step, and it "
                "would train the epoch's first batches again (a batch read ahead with "
                "next(iter(loader)), or an evaluation over a loader with drop_last=True "
                "with gradients on); train from the first pass after the load, and "
                "evaluate with engine.evaluate, under torch.no_grad(), or on a loader "
                "made with drop_last=False."
            )

    def finished(self, reader: object) -> None:
        """The training pass `reader` read to the end of its epoch (any resume point it
        took is honoured, even by a pass with nothing left to read)."""
        if self._taken is not None and self._taken[0] is reader:
            self._taken = None

    def restore(
        self, step: int, epoch: int, samples_in_epoch: int, shuffle_seed: int | None
    ) -> None:
        """A checkpoint was loaded: training stands after `step`, `samples_in_epoch` into
        `epoch` (also what a save before the loader's next pass records), which the next
        training pass skips (`take_resume`)."""
        self.step = step
        self.epoch = epoch
        self.samples_in_epoch = samples_in_epoch
        self.resume_at = (epoch, samples_in_epoch)
        self.shuffle_seed = shuffle_seed

    def enter(self, epoch: int, per_step: int, shuffle_seed: int | None) -> None:
        """Training is now at the start of `epoch` of a loader other than dtrain's, taking
        `per_step` samples a step, shuffled by `shuffle_seed` (``engine.progress``'s)."""
        self.epoch = epoch
        self.samples_in_epoch = 0
        self.samples_per_step = per_step
        self.shuffle_seed = shuffle_seed
        self._trains = self._newest = None

    def read(self, reader: TrainingPass) -> None:
        """The training pass `reader` yielded a batch (it counted it itself)."""
        self._newest = reader

    def stepped(self, step: int, one_batch: bool) -> None:
        """Optimizer step `step` was taken: count it and commit the batches it trained
        (`one_batch`: a step of `engine.train_step`, which trains one batch of the loader).

        It trains from the pass it trained from before while that one holds batches read
        and not yet trained (read ahead), else from the pass that read last since the
        previous step (the next epoch's; a validation pass read between steps is never
        followed by a step of its own), else again from the same one (batches it did not
        read: replayed by ``itertools.cycle``, refused at the resume). A step of
        `engine.train_step` trains one batch; a step written by hand the batches its pass
        read for its first step, then those read between its first and second steps (the
        batches it accumulates; a pass one batch ahead reads one more before its first).
        """
        self.step = step
        trains, newest = self._trains, self._newest
        self._newest = None
        if newest is not None and (trains is None or trains.trained() >= trains.read):
            trains = self._trains = newest
        if trains is None:  # engine.progress over a loader of the user's
            self.samples_in_epoch += self.samples_per_step
            return
        trains.step(one_batch)
        self.epoch = trains.epoch
        self.samples_in_epoch = trains.trained() * trains.per_step
        self.samples_per_step = trains.per_step
        self.shuffle_seed = trains.seed


@dataclass(eq=False)
class TrainingPass:
    """One training pass over a loader of `engine.dataloader`, as the position counts it:
    batches in its epoch's order, each of `per_step` samples."""

    epoch: int
    per_step: int
    seed: int | None
    """Its shuffle seed (None: not shuffled)."""
    start: int
    """The batches of the epoch trained before it (skipped after a load)."""
    read: int
    """The batches of the epoch read: `start`, then one more at each yield."""
    steps: int = 0
    """The steps trained from it."""
    per: int = 0
    """Batches a step trains (learnt by steps written by hand)."""
    read_at_step: int = 0
    """`read` at its last step."""

    def trained(self) -> int:
        """The batches of the epoch trained (more than `read` once a step trains batches
        the pass never read)."""
        return self.start + self.steps * self.per

    def step(self, one_batch: bool) -> None:
        """A step trained from this pass: one batch (`one_batch`), or by hand the batches
        read for its first step, then (from the second) those read between the two."""
        self.steps += 1
        if one_batch:
            self.per = 1
        elif self.steps == 1:
            self.per = max(self.read - self.start, 1)
        elif self.steps == 2 and self.read > self.read_at_step:
            self.per = self.read - self.read_at_step
        self.read_at_step = self.read
