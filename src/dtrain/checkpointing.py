"""The Engine's checkpoint methods: save, load, resume, state_dict.

A mixin of :class:`dtrain.Engine`, kept in its own file so the engine's loop mechanics
and its checkpoint handling can each be read alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtrain import checkpoint, rng
from dtrain.checkpoint.plain import read_model_state
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError
from dtrain.observe.logs import LOGGER

if TYPE_CHECKING:
    from dtrain.engine import Engine


class Checkpointing:
    """save / load / resume for :class:`dtrain.Engine` (which provides the state)."""

    def state_dict(self: Engine) -> dict[str, torch.Tensor] | None:
        """The whole model under canonical names on the CPU, on the main rank (None on the
        others). Collective: every rank must call it (sharded strategies gather)."""
        self._require_setup("engine.state_dict")
        tensors, _ = self.strategy.full_state(None)
        return tensors

    def save(
        self: Engine,
        path: str | Path,
        epoch: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Write a checkpoint directory at `path` (rank 0 writes, all ranks wait).

        Args:
            path: the checkpoint directory; replaced atomically if it exists.
            epoch: the epoch to record (default: the one `progress` is in).
            extra: more manifest fields (JSON values).
        """
        self._require_setup("engine.save")
        tensors, optimizer_state = self.strategy.full_state(self.optimizer)
        rng_states = self._gather(rng.get_state())
        if self.is_main:
            assert tensors is not None
            position = {
                "step": self.step,
                "epoch": self.epoch if epoch is None else epoch,
                "samples_in_epoch": self._samples_in_epoch,
            }
            info = {
                **position,
                "strategy": self.strategy.name,
                "world_size": self.world_size,
                "model_class": self.strategy.model_class,
                "optimizer": type(self.optimizer).__name__ if self.optimizer else None,
                **(extra or {}),
            }
            trainer = {**position, "rng_per_rank": rng_states}
            checkpoint.write(Path(path), tensors, optimizer_state, trainer, info)
            LOGGER.info("saved checkpoint %s at step %d", path, self.step)
        self.barrier()

    def load(self: Engine, path: str | Path, strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint written under any strategy and world size; return its manifest.

        Restores the model, the optimizer (if given to setup), the step count, the data
        position (the next `progress` calls skip what was trained) and each rank's RNG
        state. `path` may also be a plain PyTorch or safetensors file (a state_dict, one
        under a key such as ``state_dict``, ``module.``/``_orig_mod.`` names): then only
        the model is loaded. With strict=False, tensors that do not fit are skipped (and
        logged) instead of stopping.
        """
        self._require_setup("engine.load")
        path = Path(path)
        if path.is_file():
            skipped = self.strategy.load_full_state(read_model_state(path), None, None, strict)
            self._log_skipped(path, skipped)
            return {"format": "plain", "path": str(path)}
        manifest = checkpoint.read_manifest(path)
        problems = verify(path)
        if problems:
            raise CheckpointError(
                f"{path} is damaged ({'; '.join(problems)}); nothing was loaded. Resume from "
                "an older checkpoint (engine.resume picks the newest intact one)."
            )
        optimizer_state = checkpoint.read_pt(path, "optimizer.pt")
        if self.optimizer is not None and optimizer_state is None:
            LOGGER.warning("%s holds no optimizer state; the optimizer starts fresh", path)
            self.print(
                f"dtrain: note: {path} holds no optimizer state; the optimizer starts fresh."
            )
        skipped = self.strategy.load_full_state(
            checkpoint.read_model(path), self.optimizer, optimizer_state, strict
        )
        self._log_skipped(path, skipped)
        trainer = checkpoint.read_pt(path, "trainer.pt") or {}
        self.step = int(trainer.get("step", manifest["step"]))
        self.epoch = int(trainer.get("epoch", manifest["epoch"]))
        self._resume_at = (self.epoch, int(trainer.get("samples_in_epoch", 0)))
        rng_states = trainer.get("rng_per_rank") or []
        if rng_states:
            # Same number of processes: every rank continues its own streams; else rank 0's.
            group = self.strategy.train_group
            ranks = dist.get_world_size(group) if dist.is_initialized() else 1
            me = dist.get_rank(group) if dist.is_initialized() else 0
            rng.set_state(rng_states[me if len(rng_states) == ranks else 0])
        LOGGER.info("loaded checkpoint %s (step %d, epoch %d)", path, self.step, self.epoch)
        return manifest

    def resume(self: Engine, root: str | Path) -> dict[str, Any] | None:
        """Load the newest intact checkpoint under `root`; None if there is none.

        A damaged newer checkpoint is skipped with a warning, so a run killed while its
        disk was failing falls back to the one before.
        """
        latest, warnings = checkpoint.latest_intact(Path(root))
        for warning in warnings:
            LOGGER.warning(warning)
            self.print(f"dtrain: warning: {warning}")
        return self.load(latest) if latest is not None else None

    @property
    def restart_count(self) -> int:
        """How many times the launcher has restarted the group (0 on the first attempt)."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def _log_skipped(self: Engine, path: Path, skipped: list[str]) -> None:
        if skipped:
            LOGGER.warning("loaded %s partially; skipped %s", path, ", ".join(skipped))
            self.print(f"dtrain: warning: loaded {path} partially; skipped {', '.join(skipped)}")
