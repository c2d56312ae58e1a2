"""Where training stands: the counters a checkpoint restores besides the states."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.errors import SetupError


@dataclass
class Position:
    """The run's optimizer steps and data position, shared by the Engine (which counts
    steps), the training loader (which moves the data position, `dtrain.resumable`) and
    its checkpoints (which save and restore them)."""

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

    def enter(self, epoch: int, trained: int, per_step: int, shuffle_seed: int | None) -> None:
        """Training is now in `epoch`, `trained` samples into it, taking `per_step` a step
        from a loader shuffled by `shuffle_seed`."""
        self.epoch = epoch
        self.samples_in_epoch = trained
        self.samples_per_step = per_step
        self.shuffle_seed = shuffle_seed
