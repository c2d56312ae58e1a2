"""Checkpoints of a run: save, load, resume, state_dict.

The Engine holds one :class:`Checkpoints`; it sees the strategy (which gathers and
scatters the states) and the run's :class:`Position` (which it saves and restores), and
nothing else of the Engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from dtrain import checkpoint, rng
from dtrain.checkpoint.plain import read_model_state
from dtrain.checkpoint.verify import verify
from dtrain.collectives import barrier, gather_objects, rank_in
from dtrain.errors import CheckpointError
from dtrain.observe.logs import LOGGER
from dtrain.position import Position
from dtrain.strategies import Strategy


class Checkpoints:
    """save / load / resume of one Engine's strategy, optimizer and position."""

    def __init__(self, strategy: Strategy, position: Position) -> None:
        self.strategy = strategy
        self.position = position
        self.optimizer: Optimizer | None = None
        """The optimizer the loop steps (set by `engine.setup`)."""

    @property
    def is_main(self) -> bool:
        return self.strategy.topology.is_main

    def print(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model under canonical names on the CPU, on the main rank (None on the
        others). Collective: every rank must call it (sharded strategies gather)."""
        tensors, _ = self.strategy.full_state(None)
        return tensors

    def save(
        self,
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
        tensors, optimizer_state = self.strategy.full_state(self.optimizer)
        rng_states = gather_objects(rng.get_state(), self.strategy.train_group)
        if self.is_main:
            assert tensors is not None
            position = {
                "step": self.position.step,
                "epoch": self.position.epoch if epoch is None else epoch,
                "samples_in_epoch": self.position.samples_in_epoch,
            }
            info = {
                **position,
                "strategy": self.strategy.name,
                "world_size": self.strategy.topology.world_size,
                "model_class": self.strategy.model_class,
                "optimizer": type(self.optimizer).__name__ if self.optimizer else None,
                **(extra or {}),
            }
            trainer = {**position, "rng_per_rank": rng_states}
            checkpoint.write(Path(path), tensors, optimizer_state, trainer, info)
            LOGGER.info("saved checkpoint %s at step %d", path, self.position.step)
        barrier(self.strategy.train_group)

    def load(self, path: str | Path, strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint written under any strategy and world size; return its manifest.

        Restores the model, the optimizer (if given to setup), the step count, the data
        position (the next `progress` calls skip what was trained) and each rank's RNG
        state. `path` may also be a plain PyTorch or safetensors file (a state_dict, one
        under a key such as ``state_dict``, ``module.``/``_orig_mod.`` names): then only
        the model is loaded. With strict=False, tensors that do not fit are skipped (and
        logged) instead of stopping.
        """
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
        where = self.position
        where.step = int(trainer.get("step", manifest["step"]))
        where.epoch = int(trainer.get("epoch", manifest["epoch"]))
        where.resume_at = (where.epoch, int(trainer.get("samples_in_epoch", 0)))
        rng_states = trainer.get("rng_per_rank") or []
        if rng_states:
            # Same number of processes: every rank continues its own streams; else rank 0's.
            me, ranks = rank_in(self.strategy.train_group)
            rng.set_state(rng_states[me if len(rng_states) == ranks else 0])
        LOGGER.info("loaded checkpoint %s (step %d, epoch %d)", path, where.step, where.epoch)
        return manifest

    def resume(self, root: str | Path) -> dict[str, Any] | None:
        """Load the newest intact checkpoint under `root`; None if there is none.

        A damaged newer checkpoint is skipped with a warning, so a run killed while its
        disk was failing falls back to the one before.
        """
        latest, warnings = checkpoint.latest_intact(Path(root))
        for warning in warnings:
            LOGGER.warning(warning)
            self.print(f"dtrain: warning: {warning}")
        return self.load(latest) if latest is not None else None

    def finish(self) -> None:
        """Return once every checkpoint this process started is on disk (saves are
        synchronous here, so there is nothing to wait for)."""

    def _log_skipped(self, path: Path, skipped: list[str]) -> None:
        if skipped:
            LOGGER.warning("loaded %s partially; skipped %s", path, ", ".join(skipped))
            self.print(f"dtrain: warning: loaded {path} partially; skipped {', '.join(skipped)}")
