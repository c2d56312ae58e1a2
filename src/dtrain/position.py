"""Where training stands: the counters a checkpoint restores besides the states."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Position:
    """The run's optimizer steps and data position, shared by the Engine (which counts)
    and its checkpoints (which save and restore them)."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """The epoch `engine.progress` is in."""
    samples_in_epoch: int = 0
    """Samples of the current epoch already trained."""
    samples_per_step: int = 0
    """The global batch of the current loader."""
    shuffle_seed: int | None = None
    """The shuffle seed of the loader `engine.progress` iterates (None: not shuffled). A
    checkpoint keeps it and a load restores it, and the next `progress` shuffles with it:
    the samples it skips are those the checkpoint had trained, even where the loader drew
    another seed (made after the load, or in a run whose script seeds nothing)."""
    resume_at: tuple[int, int] | None = None
    """(epoch, samples) a loaded checkpoint had trained; the next `progress` skips them."""
