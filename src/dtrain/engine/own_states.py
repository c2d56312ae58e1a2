"""What each rank trains apart from the others, kept by the Engine's checkpoints:
local-sgd's replica between syncs and PowerSGD's error feedback. How a checkpoint holds
them (an entry per rank, or one gathered list) is checkpoint/rank_states.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.optim import Optimizer

from dtrain.checkpoint import rank_states
from dtrain.checkpoint.sharded import Part
from dtrain.parallel.compression import powersgd_of
from dtrain.process.collectives import gather_to_main, rank_in
from dtrain.process.logs import LOGGER
from dtrain.strategies.base import Strategy


def own_state(strategy: Strategy, optimizer: Optimizer | None) -> dict[str, Any] | None:
    """What this rank trains apart from the others: its replica between syncs
    (local-sgd) and its PowerSGD error feedback; None, alike on every rank, if neither."""
    replica = strategy.replica_state(optimizer)
    powersgd = powersgd_of(strategy.model)
    if replica is None and powersgd is None:
        return None
    return {"replica": replica, "powersgd": powersgd.state_dict() if powersgd else None}


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
    `trainer`): its replica (where the whole model was `model_loaded`; at another number
    of ranks every replica goes on from the saved model) and its PowerSGD state."""
    me, ranks = rank_in(strategy.placement.train_group)
    mine, first = rank_states.own_and_first(path, trainer, me, ranks)
    replica = first.get("replica") if first else None
    if replica is not None and model_loaded:
        own = mine["replica"] if mine else None
        strategy.load_replica_state(own, replica, optimizer)
        if own is None and replica.get("since_sync"):
            say(
                f"dtrain: note: {path} was saved by replicas between two syncs at another "
                f"number of ranks; the {ranks} replicas now start from their mean, as after "
                "a sync."
            )
    _restore_powersgd(path, strategy, mine, ranks, say)


def _restore_powersgd(
    path: Path,
    strategy: Strategy,
    mine: dict[str, Any] | None,
    ranks: int,
    say: Callable[[str], None],
) -> None:
    """Continue this rank's PowerSGD state from `mine` (its own state in the checkpoint);
    where the checkpoint holds none for this job (another world size or PowerSGD rank,
    or none saved), warn and let PowerSGD start afresh: two whole steps, then compression
    with no error feedback carried over (another job's errors belong to other ranks'
    gradients)."""
    powersgd = powersgd_of(strategy.model)
    if powersgd is None:
        return
    state = mine.get("powersgd") if mine else None
    if powersgd.fits(state):
        powersgd.load_state_dict(state)
        return
    message = (
        f"{path} holds no PowerSGD state of {ranks} processes at rank {powersgd.rank}; "
        "PowerSGD starts afresh (its error feedback restarts from zero)"
    )
    LOGGER.warning(message)
    say(f"dtrain: warning: {message}.")
