"""Checkpoints of a run: save, load, resume, state_dict, Hugging Face folders.

The Engine holds one :class:`Checkpoints`; it sees the strategy (which gathers and
scatters the states) and the run's :class:`Position` (which it saves and restores), and
nothing else of the Engine. ``checkpoint_format`` picks the layout written: consolidated
(the main rank writes the whole model in one safetensors file) or sharded (every rank
writes its part with torch.distributed.checkpoint); both load under any strategy.

The Engine's own methods of the same names are `checkpoint_side.CheckpointSide`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from dtrain import advice, checkpoint
from dtrain.checkpoint.atomic import clean_leftovers
from dtrain.checkpoint.directory import ROTATED_AS, problems_of
from dtrain.checkpoint.flat_optimizer import merge_groups
from dtrain.checkpoint.format import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    expected_shapes,
    is_sharded,
)
from dtrain.checkpoint.hf_folder import is_model_folder, load_folder
from dtrain.checkpoint.hf_write import save_folder
from dtrain.checkpoint.lazy import LazyTensors
from dtrain.checkpoint.plain import read_model_state
from dtrain.checkpoint.sharded import ShardedWriter, local_part
from dtrain.checkpoint.sharded_load import load_sharded
from dtrain.checkpoint.shared import decided_by_main
from dtrain.checkpoint.verify import verify
from dtrain.engine import own_states
from dtrain.errors import CheckpointError, DamagedCheckpointError
from dtrain.observe.events import Observer, Run
from dtrain.process import rng
from dtrain.process.collectives import gather_objects, rank_in
from dtrain.process.logs import LOGGER
from dtrain.step.position import Position
from dtrain.step.precision import LossScaling
from dtrain.strategies.base import Strategy


class Checkpoints(Observer):
    """save / load / resume of one Engine's strategy, optimizer and position (it observes
    the Engine's setup, which makes the optimizer).

    Args:
        strategy: gathers and scatters the states.
        position: where training stands, saved and restored.
        loss_scaling: fp16-mixed's loss scale, saved and restored with the trainer state.
    """

    def __init__(
        self, strategy: Strategy, position: Position, loss_scaling: LossScaling | None
    ) -> None:
        self.strategy = strategy
        self.position = position
        self.loss_scaling = loss_scaling
        self.last_path: Path | None = None
        """The newest checkpoint this process saw complete."""
        self.optimizer: Optimizer | None = None
        """The optimizer the loop steps (from `engine.setup`)."""
        self._sharded = ShardedWriter(strategy)
        self._cleaned: set[Path] = set()
        """The folders where this run removed earlier attempts' interrupted writes."""

    def on_setup(self, run: Run) -> None:
        self.optimizer = run.optimizer

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

    # -- saving ---------------------------------------------------------------------------
    def save(
        self,
        path: str | Path,
        epoch: int | None = None,
        extra: dict[str, Any] | None = None,
        keep: int | None = None,
    ) -> None:
        """Write a checkpoint directory at `path` (collective: every rank calls it).

        Consolidated: rank 0 writes, every rank waits. Sharded: every rank writes its
        part; with ``async_checkpoint`` the writing goes on in the background (the next
        save, a load and `finish` wait for it) and the checkpoint appears once complete.
        A write the disk refuses (full, over quota, read-only) raises a CheckpointError on
        every rank that says what to do (`checkpoint.disk`); the checkpoints before it stay
        intact.

        Args:
            path: the checkpoint directory; replaced atomically if it exists.
            epoch: the epoch to record (default: the one the training loader is in).
            extra: more manifest fields (JSON values).
            keep: once the checkpoint is complete, delete all but the newest `keep`
                checkpoints that saves with `keep` wrote beside it (the main rank does; no
                other rank reads them); other folders there are never deleted.
        """
        path = Path(path)
        self._sharded.wait()
        self._clean_once(path.parent)
        position = {
            "step": self.position.step,
            "epoch": self.position.epoch if epoch is None else epoch,
            "samples_in_epoch": self.position.samples_in_epoch,
        }
        # The same on every rank: the ranks agree on every skipped step.
        scaler = {"loss_scaler": self.loss_scaling.state_dict()} if self.loss_scaling else {}
        info = {
            **position,
            "strategy": self.strategy.name,
            "world_size": self.strategy.topology.world_size,
            "model_class": self.strategy.model_class,
            "optimizer": type(self.optimizer).__name__ if self.optimizer else None,
            **({ROTATED_AS: path.name} if keep is not None else {}),  # prune may delete it
            **(extra or {}),
        }

        def committed() -> None:
            LOGGER.info("saved checkpoint %s at step %d", path, position["step"])
            self.last_path = path
            if keep is not None:
                checkpoint.prune(path.parent, keep, written=path)

        group = self.strategy.placement.train_group
        own = self.strategy.own_state(self.optimizer)
        if self.strategy.config.checkpoint_format == "sharded":
            part = local_part(self.strategy, self.optimizer)
            everyone = gather_objects((rng.get_state(), part.groups), group)
            trainer = {
                **position,
                "shuffle_seed": self.position.shuffle_seed,
                "rng_per_rank": [state for state, _ in everyone],
                "optimizer_groups": merge_groups([groups for _, groups in everyone]),
                **scaler,
                **own_states.record(self.strategy, own, part),
            }
            self._sharded.save(path, part, trainer, info, committed)
            return
        tensors, optimizer_state = self.strategy.full_state(self.optimizer)
        rng_states = gather_objects(rng.get_state(), group)
        owns = own_states.record(self.strategy, own, None)

        def write() -> None:
            assert tensors is not None
            trainer = {
                **position,
                "shuffle_seed": self.position.shuffle_seed,
                "rng_per_rank": rng_states,
                **scaler,
                **owns,
            }
            checkpoint.write(path, tensors, optimizer_state, trainer, info)
            committed()

        # The other ranks wait for it, and raise its error (a full disk) if it fails.
        decided_by_main(write, group, self.is_main)

    def save_pretrained(self, path: Path) -> None:
        """Write the model as a Hugging Face folder (`checkpoint.hf_write.save_folder`)."""
        save_folder(self.strategy, path, self.strategy.user_model(), self.is_main)

    def saved(self, path: str | Path) -> bool:
        """Whether the newest checkpoint beside `path` is `path`, intact (or is being
        written there); decided on the main rank, the same answer on every rank
        (collective). A damaged one that `resume` skipped counts as not saved, so the
        run writes it again when it reaches its step."""
        path = Path(path)

        def decide() -> bool:
            if self._sharded.pending_target == path:
                return True
            if checkpoint.find_latest(path.parent) != path:
                return False
            return self.last_path == path or not problems_of(path)

        return decided_by_main(decide, self.strategy.placement.train_group, self.is_main)

    def finish(self) -> None:
        """Return once every checkpoint this process started is on disk (an asynchronous
        save's error is raised here)."""
        self._sharded.close()

    # -- loading --------------------------------------------------------------------------
    def load(self, path: str | Path, strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint written under any strategy and world size; return its manifest.

        Restores the model, the optimizer (if given to setup), the step count, the data
        position (the training loader's next pass, in any loop, skips what was trained,
        whether the loader was made before or after the load) and each rank's RNG
        state. `path` may also be a plain PyTorch or safetensors file (a state_dict, one
        under a key such as ``state_dict``, ``module.``/``_orig_mod.`` names): then only
        the model is loaded; likewise for a Hugging Face model folder (``config.json`` and
        safetensors, sharded with an index), whose tensors each rank reads only as far as
        it holds them (`dtrain.checkpoint.hf_folder`). With strict=False, tensors that do
        not fit are skipped (and logged) instead of stopping. The main rank checks the
        files against the manifest and tells the others; each rank then reads only the
        tensors it holds.
        """
        self._sharded.wait()
        path = Path(path)
        if path.is_file():
            skipped = self.strategy.load_full_state(read_model_state(path), None, None, strict)
            self._log_skipped(path, skipped)
            return {"format": "plain", "path": str(path)}
        if is_model_folder(path):
            # The optimizer, step and data position stay: fine-tuning starts at step 0.
            folder, skipped = load_folder(path, self.strategy, strict, self.is_main)
            self._log_skipped(path, skipped)
            return {"format": "huggingface", "path": str(path), "config": folder.config}

        def check() -> dict[str, Any]:
            manifest = checkpoint.read_manifest(path)
            problems = verify(path)
            if problems:
                raise CheckpointError(
                    f"{path} is damaged ({'; '.join(problems)}); nothing was loaded. Resume "
                    f"from an older checkpoint ({advice.newest_intact()})."
                )
            return manifest

        manifest = decided_by_main(check, self.strategy.placement.train_group, self.is_main)
        return self._load_checked(path, manifest, strict)

    def resume(self, root: str | Path) -> dict[str, Any] | None:
        """Load the newest intact checkpoint under `root`; None if there is none.

        A damaged newer checkpoint is skipped with a warning, so a run killed while its
        disk was failing falls back to the one before; so is one whose files match its
        manifest but cannot be read (a DamagedCheckpointError, met by every rank alike).
        The main rank looks for it and checks it; the others load what it found.
        """
        self._sharded.wait()
        self._clean_once(Path(root))
        below: Path | None = None  # the newest one found unreadable: look below it

        def find() -> tuple[Path | None, list[str], dict[str, Any] | None]:
            latest, warnings = checkpoint.latest_intact(Path(root), below)
            return latest, warnings, checkpoint.read_manifest(latest) if latest else None

        def warn(warning: str) -> None:
            LOGGER.warning(warning)
            self.print(f"dtrain: warning: {warning}")

        group = self.strategy.placement.train_group
        while True:
            latest, warnings, manifest = decided_by_main(find, group, self.is_main)
            for warning in warnings:
                warn(warning)
            if latest is None or manifest is None:
                return None
            try:
                return self._load_checked(latest, manifest, strict=True)
            except DamagedCheckpointError as e:
                warn(f"skipping damaged checkpoint {latest}: {e}")
                below = latest

    def _clean_once(self, root: Path) -> None:
        """Main rank: remove what earlier attempts' interrupted saves left under `root`
        (`checkpoint.atomic.clean_leftovers`), the first time this run saves or resumes
        there. Every caller has first waited for this run's own save in flight, so no
        folder removed is one this run is writing."""
        if self.is_main and root not in self._cleaned:
            self._cleaned.add(root)
            clean_leftovers(root)

    def _load_checked(self, path: Path, manifest: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Load the checkpoint at `path`, whose files the main rank found intact."""
        trainer = checkpoint.read_pt(path, TRAINER_FILE) or {}
        if is_sharded(manifest):
            skipped, with_optimizer = load_sharded(
                path, self.strategy, self.optimizer, strict, trainer.get("optimizer_groups")
            )
        else:
            optimizer_state = checkpoint.read_pt(path, OPTIMIZER_FILE, mmap=True)
            with_optimizer = optimizer_state is not None
            # Tensors this rank does not hold (another pipeline stage's) are never read.
            held = set(expected_shapes(self.strategy.unwrap()))
            tensors = LazyTensors(path / MODEL_FILE, held)
            skipped = self.strategy.load_full_state(
                tensors, self.optimizer, optimizer_state, strict
            )
        if self.optimizer is not None and not with_optimizer:
            LOGGER.warning("%s holds no optimizer state; the optimizer starts fresh", path)
            self.print(
                f"dtrain: note: {path} holds no optimizer state; the optimizer starts fresh."
            )
        self._log_skipped(path, skipped)
        self.position.restore(
            int(trainer.get("step", manifest["step"])),
            int(trainer.get("epoch", manifest["epoch"])),
            int(trainer.get("samples_in_epoch", 0)),
            trainer.get("shuffle_seed"),
        )
        if self.loss_scaling is not None and "loss_scaler" in trainer:
            self.loss_scaling.load_state_dict(trainer["loss_scaler"])
        me, ranks = rank_in(self.strategy.placement.train_group)
        rng_states = trainer.get("rng_per_rank") or []
        if rng_states:
            # Same number of processes: every rank continues its own streams; else rank 0's.
            rng.set_state(rng_states[me if len(rng_states) == ranks else 0])
        own_states.restore(path, trainer, self.strategy, self.optimizer, not skipped, self.print)
        at = self.position
        LOGGER.info("loaded checkpoint %s (step %d, epoch %d)", path, at.step, at.epoch)
        return manifest

    def _log_skipped(self, path: Path, skipped: list[str]) -> None:
        if skipped:
            message = (
                f"loaded {path} partially; skipped {', '.join(skipped)} (they keep their "
                "values, and their optimizer state starts fresh)"
            )
            LOGGER.warning(message)
            self.print(f"dtrain: warning: {message}")
