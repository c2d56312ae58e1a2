"""The Engine's checkpoint methods: save, save_pretrained, load, resume, state_dict.

:class:`CheckpointSide` is a base class of the Engine: it checks the losses since the last
read before a checkpoint is written or left, tells the observers of a load, and hands the
work to the run's `checkpoints.Checkpoints`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtrain.engine.checkpoints import Checkpoints
from dtrain.observe.events import Observers
from dtrain.observe.loss_reads import LossReads
from dtrain.step.position import Position


class CheckpointSide:
    """The Engine's checkpoint methods (a base class of the Engine, which sets the
    attributes below): the losses since the last read are checked before a checkpoint
    is written or left, and the observers are told of a load."""

    checkpoints: Checkpoints
    position: Position
    observers: Observers
    _loss: LossReads
    _require_setup: Callable[[str], None]
    """The Engine's refusal of a call before `engine.setup`."""

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model under canonical names on the CPU, on the main rank (None on the
        others). Collective: every rank must call it (sharded strategies gather)."""
        self._require_setup("engine.state_dict")
        return self.checkpoints.state_dict()

    def save(
        self,
        path: str | Path,
        epoch: int | None = None,
        extra: dict[str, Any] | None = None,
        keep: int | None = None,
    ) -> None:
        """Write a checkpoint directory at `path` (collective; see :class:`Checkpoints`).

        Args:
            path: the checkpoint directory; replaced atomically if it exists.
            epoch: the epoch to record (default: the one the training loader is in).
            extra: more manifest fields (JSON values).
            keep: once it is complete, delete all but the newest `keep` checkpoints
                that saves with `keep` wrote beside it.
        """
        self._require_setup("engine.save")
        self._loss.flush()  # a non-finite loss must never reach a checkpoint
        self.checkpoints.save(path, epoch, extra, keep)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the model as a Hugging Face model folder at `path` that transformers'
        ``from_pretrained`` reads: config.json (from the model's ``config``, when it has
        one), the weights as safetensors, sharded past 5 GiB with their index, a tied
        weight once. Collective: where the parameters are DTensors (zero2, zero3, hsdp,
        tensor) every rank writes its own slices and the main rank joins them from disk
        file by file; elsewhere the main rank writes the model (a pipeline's stages sent to
        it). The folder appears whole or not at all, and an existing model folder there is
        replaced."""
        self._require_setup("engine.save_pretrained")
        self._loss.flush()  # a non-finite loss must never reach a saved model
        self.checkpoints.save_pretrained(Path(path))

    def load(self, path: str | Path, strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint written under any strategy and world size, or a plain
        PyTorch / safetensors file; return its manifest (see :meth:`Checkpoints.load`)."""
        self._require_setup("engine.load")
        self._loss.flush()  # the steps before the load are checked before they are left
        manifest = self.checkpoints.load(path, strict)
        self.observers.on_resume(self.position.step)
        return manifest

    def resume(self, root: str | Path) -> dict[str, Any] | None:
        """Load the newest intact checkpoint under `root`; None if there is none."""
        self._require_setup("engine.resume")
        manifest = self.checkpoints.resume(root)
        if manifest is not None:
            self.observers.on_resume(self.position.step)
        return manifest
