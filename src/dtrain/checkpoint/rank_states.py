"""Each rank's own state: what a rank trains apart from the others (local-sgd's replica
between syncs, PowerSGD's error feedback), saved so that every rank resumes its own.

A consolidated checkpoint has one writer, so the ranks' states are gathered into its
trainer file (``rank_states``: a list in rank order). A sharded checkpoint whose ranks
write their own parts keeps each rank's state as an entry of its own (``ranks.R``: the
bytes of a ``torch.save`` of it, as a uint8 tensor), written by that rank, so that no
rank ever holds the others'; its trainer file records how many ranks wrote them
(``rank_states_written``). `ckpt convert` gathers the entries into the consolidated
checkpoint's list.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.dcp_io import read_entries
from dtrain.checkpoint.format import load_pt

RANKS = "ranks."
"""The prefix of the rank-state entries of a sharded checkpoint's index."""
LISTED = "rank_states"
"""The trainer file's key of every rank's state, gathered."""
WRITTEN = "rank_states_written"
"""The trainer file's key of how many ranks wrote their state as an entry."""


def entry_key(rank: int) -> str:
    """The index key of rank `rank`'s state in a sharded checkpoint."""
    return f"{RANKS}{rank}"


def as_entry(state: dict[str, Any]) -> torch.Tensor:
    """`state` as one entry of a sharded checkpoint: the bytes of its ``torch.save``, as a
    tensor (DCP would pickle any other object, a BytesIO included, around them)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_entry(entry: torch.Tensor, key: str) -> dict[str, Any]:
    """The state `as_entry` stored under `key`, read with weights_only=True."""
    data = io.BytesIO(entry.numpy().tobytes())
    return load_pt(data, "Load checkpoints written by code you trust.", what=f"The entry {key}")


def own_and_first(
    path: Path, trainer: dict[str, Any], me: int, ranks: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Rank `me`'s state (None where `ranks` processes did not write the checkpoint) and
    the first rank's, from the checkpoint at `path` with trainer state `trainer`; (None,
    None) where it holds none. Reads only those two, by this process alone."""
    if LISTED in trainer:
        states = trainer[LISTED]
        return (states[me] if len(states) == ranks else None), states[0]
    written = int(trainer.get(WRITTEN, 0))
    if not written:
        return None, None
    same = written == ranks
    keys = {entry_key(0)} | ({entry_key(me)} if same else set())
    entries = {k: _from_entry(v, k) for k, v in read_entries(path, lambda k: k in keys).items()}
    return (entries.get(entry_key(me)) if same else None), entries.get(entry_key(0))


def gathered(path: Path, trainer: dict[str, Any]) -> dict[str, Any]:
    """`trainer` with its ranks' states as a list (``rank_states``), read from the entries
    of the sharded checkpoint at `path` where they are kept there: what a consolidated
    checkpoint's trainer file holds."""
    written = int(trainer.get(WRITTEN, 0))
    if not written:
        return trainer
    entries = read_entries(path, lambda key: key.startswith(RANKS))
    rest = {k: v for k, v in trainer.items() if k != WRITTEN}
    listed = [_from_entry(entries[entry_key(r)], entry_key(r)) for r in range(written)]
    return {**rest, LISTED: listed}
