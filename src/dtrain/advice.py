"""Advice that speaks to the command that is running.

The same failure calls for other words under `dtrain demo`, whose flags the user types
(--lr, --resume, --model), than under `dtrain run`, `dtrain.launch` or `horovodrun`, where
the user's own code sets the learning rate and decides whether to resume. The command
names itself in COMMAND_VAR, which every worker it starts inherits (over ssh too); a
script run with plain python has none, and is advised as a `dtrain run` script is.
Importable without torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

COMMAND_VAR = "DTRAIN_COMMAND"
"""Environment variable: the command that started this process's job (one of COMMANDS)."""
DEMO, RUN, LAUNCH, HOROVODRUN = "demo", "run", "launch", "horovodrun"
COMMANDS = (DEMO, RUN, LAUNCH, HOROVODRUN)


def running() -> str | None:
    """The command that started this process's job, or None (plain python, a test)."""
    command = os.environ.get(COMMAND_VAR)
    return command if command in COMMANDS else None


@contextlib.contextmanager
def running_as(command: str) -> Iterator[None]:
    """Name `command` to this process and to the workers it starts, for the block."""
    saved = os.environ.get(COMMAND_VAR)
    os.environ[COMMAND_VAR] = command
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(COMMAND_VAR, None)
        else:
            os.environ[COMMAND_VAR] = saved


def how_to_resume() -> str:
    """How a run stopped early continues from its last checkpoint, as a clause."""
    command = running()
    if command == DEMO:
        return "dtrain demo continues from the last checkpoint with --resume"
    if command == HOROVODRUN:
        return "a script that loads its last checkpoint continues from there"
    return f"a {_code()} that calls engine.resume continues from the last checkpoint"


def after_restart() -> str:
    """What a restarted worker group does about the last checkpoint, as a sentence."""
    if running() == DEMO:
        return "dtrain demo resumes from its last checkpoint by itself."
    clause = how_to_resume()
    return clause[0].upper() + clause[1:] + "."


def non_finite_loss() -> str:
    """What to do about a loss that became NaN or infinite."""
    if running() == DEMO:
        return (
            "Lower the learning rate (--lr) or check the inputs for NaN or infinite values; "
            f"then {how_to_resume()}."
        )
    return (
        f"Lower the learning rate the {_code()} sets, or check its data for NaN or infinite "
        f"values; then {how_to_resume()}."
    )


def unstable_loss() -> str:
    """What to do about a loss that jumped up while training (a learning rate too high)."""
    if running() == DEMO:
        return "Lower the learning rate (--lr)."
    return f"Lower the learning rate the {_code()} sets, or warm it up over the first steps."


def checkpoint_misfit() -> str:
    """What to do about a checkpoint saved by another model."""
    if running() == DEMO:
        return (
            "Give dtrain demo the --model and --model-size that saved it, or another --out to "
            "train this model afresh."
        )
    return (
        "Load it into the model that saved it, or pass strict=False to load only the "
        "matching tensors."
    )


def newest_intact() -> str:
    """What picks the newest intact checkpoint, as a clause."""
    if running() == DEMO:
        return "dtrain demo --resume picks the newest intact one"
    return "engine.resume picks the newest intact one"


def _code() -> str:
    """What holds the user's training loop: a function under dtrain.launch, else a script."""
    return "function" if running() == LAUNCH else "script"
