"""Sharded checkpoints: every rank writes its own part with torch.distributed.checkpoint.

    manifest.json   format dtrain.sharded-checkpoint/1, step, epoch, strategy, world_size,
                    the model's tensors, every other file's size and checksum
    .metadata       DCP's index of the pieces
    __R_I.distcp    the pieces rank R wrote
    trainer.pt      data position, every rank's RNG, the optimizer's groups by name

Entries are ``model.<canonical name>`` and ``optim.<flat key>`` (`flat_optimizer`). Each
rank hands DCP what it holds (its shards under zero2/zero3/tensor/hybrid, its stage's
tensors under a pipeline, a replica that DCP writes once under ddp), so no rank ever
holds the whole model. The pieces go into a hidden directory beside the target, which
the main rank renames into place with its manifest once every piece is on disk.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import Optimizer

from dtrain.checkpoint.atomic import commit, file_records, temporary_beside
from dtrain.checkpoint.dcp_io import alone_quietly, model_entries, read_metadata
from dtrain.checkpoint.disk import save_pt, stored_bytes, writing
from dtrain.checkpoint.flat_optimizer import flatten
from dtrain.checkpoint.format import SHARDED_FORMAT, TRAINER_FILE, write_manifest
from dtrain.checkpoint.optimizer_state import state_by_name
from dtrain.checkpoint.shared import decided_by_main
from dtrain.errors import CheckpointError
from dtrain.process.collectives import gather_objects, rank_in

if TYPE_CHECKING:
    from collections.abc import Callable

    from dtrain.checkpoint.holder import StateHolder


@dataclass
class Part:
    """What one rank writes: its entries, its optimizer groups by name, and whether the
    main rank writes every entry alone (the whole state, gathered by `holder.full_state`,
    where no rank has an entry of its own to add)."""

    state: dict[str, Any]
    groups: list[list[str]] | None
    alone: bool


def local_part(holder: StateHolder, optimizer: Optimizer | None) -> Part:
    """This rank's part of a sharded checkpoint (collective: every rank calls it)."""
    if not holder.state_by_module:
        # zero1's and ps's optimizers keep state the module does not see: gather it.
        tensors, optimizer_state = holder.full_state(optimizer)
        if tensors is None:
            return Part({}, None, alone=True)
        return Part(_entries(tensors, optimizer_state), _groups(optimizer_state), alone=True)
    holder.refresh()
    module = holder.unwrap()
    # The optimizer's own tensors by name, uncopied: `get_optimizer_state_dict` would give
    # the same, but first takes a zero-lr step on an optimizer that has not stepped yet,
    # which the Engine would count as a training step.
    optimizer_state = state_by_name(optimizer, module, lambda t: t) if optimizer else None
    return Part(
        _entries(get_model_state_dict(module), optimizer_state),
        _groups(optimizer_state),
        alone=False,
    )


def _entries(model: dict[str, Any], optimizer_state: dict[str, Any] | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model}
    if optimizer_state is not None:
        state["optim"] = flatten(optimizer_state)
    return state


def _groups(optimizer_state: dict[str, Any] | None) -> list[list[str]] | None:
    if optimizer_state is None:
        return None
    return [list(group["params"]) for group in optimizer_state["param_groups"]]


class ShardedWriter:
    """Writes the sharded checkpoints of one run, at most one in flight (asynchronous
    saves run in the background; the next save, a load, and `wait` wait for it)."""

    def __init__(self, holder: StateHolder) -> None:
        self.holder = holder
        self.pending_target: Path | None = None
        """Where the save in flight will appear."""
        self._pending: Future[Any] | None = None
        self._pending_size: int | None = None
        """What this rank had to write of the save in flight, in bytes."""
        self._executor: ThreadPoolExecutor | None = None
        self._background_group: dist.ProcessGroup | None = None

    @property
    def _main(self) -> bool:
        return self.holder.topology.is_main

    def save(
        self,
        target: Path,
        part: Part,
        trainer: dict[str, Any],
        info: dict[str, Any],
        on_commit: Callable[[], None],
    ) -> None:
        """Write `part` of every rank and the main rank's `trainer` state as the sharded
        checkpoint `target` (collective); `on_commit` runs on the main rank once it is in
        place. In the background with ``async_checkpoint``."""
        self.wait()
        group = self.holder.checkpoint_group
        size = stored_bytes(part.state, trainer)

        def start() -> Path:
            with writing(target, size):
                tmp = temporary_beside(target)
            with writing(target, size, partial=tmp):
                save_pt(trainer, tmp / TRAINER_FILE)
            return tmp

        tmp = decided_by_main(start, group, self._main)
        unfinished = _Unfinished(tmp, target, info, on_commit, size)
        background = self.holder.config.async_checkpoint
        # Whatever fails, every rank raises (the main rank's error where it alone failed).
        with unfinished.guarded(self._main):
            if background:
                self._hand_over(self._write(part, tmp, background), unfinished)
            elif part.alone:
                decided_by_main(lambda: self._write_alone(part, unfinished), group, self._main)
            else:
                self._write(part, tmp, background)  # DCP tells every rank of any failure
                records = self._records(tmp)
                decided_by_main(lambda: unfinished.finish(records), group, self._main)

    def _write_alone(self, part: Part, unfinished: _Unfinished) -> None:
        """Main rank: write the whole state `part` and finish the checkpoint."""
        with unfinished.guarded(main=True):
            self._write(part, unfinished.tmp, background=False)
            unfinished.finish(file_records(unfinished.tmp, _files(unfinished.tmp)))

    def _records(self, tmp: Path) -> dict[str, dict[str, object]]:
        """The size and checksum of every file in `tmp`; every rank checksums a share of
        the files, in parallel."""
        group = self.holder.checkpoint_group
        me, ranks = rank_in(group)
        shares = gather_objects(file_records(tmp, _files(tmp)[me::ranks]), group)
        return {name: record for share in shares for name, record in share.items()}

    def _hand_over(self, upload: Future[Any] | None, unfinished: _Unfinished) -> None:
        """Let the upload run on; the main rank finishes the checkpoint once it is done."""
        self.pending_target = unfinished.target
        self._pending_size = unfinished.size
        if not self._main:
            self._pending = upload
            return
        self._executor = self._executor or ThreadPoolExecutor(1, "dtrain-checkpoint")
        self._pending = self._executor.submit(_finish_after, upload, unfinished)

    def _write(self, part: Part, tmp: Path, background: bool) -> Future[Any] | None:
        """Hand `part` to DCP (every rank, or the main rank alone); the upload's future
        when in the background."""
        group = self.holder.checkpoint_group
        if background and dist.is_initialized():
            # The upload's collectives run beside training's, so they get a group of their
            # own; DCP also wants one that works on the CPU (gloo), even for one writer.
            group = self._background_group = self._background_group or _gloo_group(group)
        if part.alone and not self._main:
            return None
        distributed = dist.is_initialized() and not part.alone
        save = dcp.async_save if background else dcp.save
        with alone_quietly():
            upload = save(
                part.state, checkpoint_id=tmp, process_group=group, no_dist=not distributed
            )
        return upload if background else None

    def wait(self) -> None:
        """Return once the save in flight (if any) is on disk; its error if it failed (the
        disk's refusal as `disk.writing` words it)."""
        pending, target = self._pending, self.pending_target
        self._pending = self.pending_target = None
        if pending is None or target is None:
            return
        try:
            with writing(target, self._pending_size):
                pending.result()
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"The background save of {target} failed ({type(e).__name__}: {e}); the "
                "checkpoints before it are intact. Check the disk and save again."
            ) from e

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None


def _gloo_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new gloo group of `group`'s ranks (only they take part in creating it)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    ranks = ranks or list(range(dist.get_world_size()))
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def _files(directory: Path) -> list[str]:
    return sorted(f.name for f in directory.iterdir())


@dataclass
class _Unfinished:
    """A checkpoint whose pieces go into the hidden directory `tmp`, to appear at `target`."""

    tmp: Path
    target: Path
    info: dict[str, Any]
    on_commit: Callable[[], None]
    size: int
    """What this rank writes of it, in bytes (about)."""

    def guarded(self, main: bool) -> contextlib.AbstractContextManager[None]:
        """`disk.writing` of this checkpoint: the main rank removes `tmp` if the block
        fails."""
        return writing(self.target, self.size, partial=self.tmp if main else None)

    def finish(self, records: dict[str, dict[str, object]]) -> None:
        """Main rank, every piece on disk: write the manifest (`records`: every file's
        size and checksum), rename into place, then `on_commit`."""
        with self.guarded(main=True):
            model = model_entries(read_metadata(self.tmp))
            write_manifest(self.tmp, SHARDED_FORMAT, self.info, model, records)
            commit(self.tmp, self.target)
        self.on_commit()


def _finish_after(upload: Future[Any] | None, unfinished: _Unfinished) -> None:
    """Main rank, in the background: wait for the upload, then finish the checkpoint."""
    with unfinished.guarded(main=True):
        if upload is not None:
            upload.result()
        unfinished.finish(file_records(unfinished.tmp, _files(unfinished.tmp)))
