"""What each rank trains apart from the others, kept by the Engine's checkpoints:
local-sgd's replica between syncs and PowerSGD's error feedback, both given and taken
back by the strategy alone (`own_state`, `load_own_state`). How a checkpoint holds them
(an entry per rank, or one gathered list) is checkpoint/rank_states.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.optim import Optimizer

from dtrain.checkpoint import rank_states
from dtrain.checkpoint.sharded import Part
from dtrain.process.collectives import gather_to_main, rank_in
from dtrain.process.logs import LOGGER
from dtrain.strategies.base import Strategy


def record(strategy: Strategy, own: dict[str, Any] | None, part: Part | None) -> dict[str, Any]:
    """The trainer file's record of every rank's `own` state: under a sharded `part`,
    `own` goes into it as this rank's entry, and every rank takes part in writing it (so
    no rank holds the others'); a consolidated checkpoint gathers the states to the main
    rank, which writes them all (collective)."""
    if own is None:
        return {}
    group = strategy.placement.train_group
    me, ranks = rank_in(group)
    if part is not None:
        part.state[rank_states.entry_key(me)] = rank_states.as_entry(own)
        part.alone = False
        return {rank_states.WRITTEN: ranks}
    return {rank_states.LISTED: gather_to_main(own, group)}


def restore(
    path: Path,
    trainer: dict[str, Any],
    strategy: Strategy,
    optimizer: Optimizer | None,
    model_loaded: bool,
    say: Callable[[str], None],
) -> None:
    """Continue this rank's own state from the checkpoint at `path` (trainer state
    `trainer`) through the strategy (`load_own_state`: where the whole model was
    `model_loaded`), and tell what could not go on as it was."""
    me, ranks = rank_in(strategy.placement.train_group)
    mine, first = rank_states.own_and_first(path, trainer, me, ranks)
    for note in strategy.load_own_state(mine, first, optimizer, model_loaded):
        LOGGER.warning("%s %s", path, note)
        say(f"dtrain: note: {path} {note}")
