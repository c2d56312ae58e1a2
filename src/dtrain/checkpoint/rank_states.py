"""Each rank's own state: what a rank trains apart from the others (local-sgd's replica
between syncs, PowerSGD's error feedback), saved so that every rank resumes its own.

A consolidated checkpoint has one writer, so the ranks' states are gathered into its
trainer file (``rank_states``: a list in rank order). A sharded checkpoint keeps each
rank's state as an entry of its own (``ranks.R``: the bytes of a ``torch.save`` of it, as
a uint8 tensor), written by that rank, so that no rank ever holds the others' (where the
main rank writes the model alone, zero1's or local-sgd's, the other ranks still write
their own entry beside it); its trainer file records how many ranks wrote them
(``rank_states_written``). `ckpt convert` gathers the entries into the consolidated
checkpoint's list.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from dtrain.checkpoint.dcp_io import read_entries
from dtrain.checkpoint.format import TRUSTED, unpickle
from dtrain.checkpoint.reading import reading
from dtrain.errors import DamagedCheckpointError

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


def own_and_first(
    path: Path, trainer: dict[str, Any], me: int, ranks: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Rank `me`'s state (None where `ranks` processes did not write the checkpoint) and
    the first rank's (None where this rank's own has no replica: only a replica needs
    it), from the checkpoint at `path` with trainer state `trainer`; (None, None) where
    it holds none. Reads no other rank's entry."""
    if LISTED in trainer:
        states = trainer[LISTED]
        return (states[me] if len(states) == ranks else None), states[0]
    written = int(trainer.get(WRITTEN, 0))
    if not written:
        return None, None
    mine = _entry(path, me) if written == ranks else None
    if mine is not None and (me == 0 or mine.get("replica") is None):
        return mine, mine if me == 0 else None
    return mine, _entry(path, 0)


def gathered(path: Path, trainer: dict[str, Any]) -> dict[str, Any]:
    """`trainer` with its ranks' states as a list (``rank_states``), read from the entries
    of the sharded checkpoint at `path` where they are kept there: what a consolidated
    checkpoint's trainer file holds."""
    written = int(trainer.get(WRITTEN, 0))
    if not written:
        return trainer
    rest = {k: v for k, v in trainer.items() if k != WRITTEN}
    return {**rest, LISTED: [_entry(path, rank) for rank in range(written)]}


def _entry(path: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s state from its entry of the sharded checkpoint at `path`."""
    key = entry_key(rank)
    found = read_entries(path, lambda k: k == key)
    if key not in found:
        raise DamagedCheckpointError(
            f"{path} says {rank + 1} or more ranks saved their own state, but holds no entry "
            f"{key}; the checkpoint is damaged. Resume from an older checkpoint."
        )
    data = io.BytesIO(found[key].numpy().tobytes())
    what = f"The entry {key} of {path}"
    with reading(what):
        return unpickle(data, TRUSTED, what=what)
