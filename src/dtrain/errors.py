"""User-facing errors: each says what was wrong and what to do next.

Every error dtrain raises for bad input derives from :class:`DtrainError`. The CLI and the
launcher print its message without a traceback from inside torch, and exit non-zero.
"""

from __future__ import annotations

import signal

from dtrain import advice


class DtrainError(Exception):
    """A problem the user can fix; the message names it and the fix."""


class ConfigError(DtrainError):
    """An option, or a combination of options, that cannot work."""


class SetupError(DtrainError):
    """The Engine was used out of order (for example `backward` before `setup`)."""


class NonFiniteLossError(DtrainError):
    """The loss became NaN or infinite; training stopped before any checkpoint took it in.

    The loss is read back from the device every ``--log-every`` steps (and before every
    checkpoint); the check runs before that step's update, so with ``--log-every 1`` no
    non-finite update is ever applied.
    """

    def __init__(self, step: int, value: float, rank: int | None = None) -> None:
        where = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"The loss is {value} at step {step}{where}: training stopped before any "
            "checkpoint took in that step, so the last checkpoint on disk is intact. "
            f"{advice.non_finite_loss()}"
        )
        self.step = step
        self.value = value
        self.rank = rank


class CheckpointError(DtrainError):
    """A checkpoint is missing, malformed, or belongs to another model."""


class DamagedCheckpointError(CheckpointError):
    """A file of a checkpoint cannot be read although its manifest vouches for it;
    `resume` passes over that checkpoint to the one before."""


class LaunchError(DtrainError):
    """One or more worker processes failed; the message names the ranks."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Stopped(DtrainError):
    """The launcher was stopped by a signal (Ctrl-C, SIGTERM); every worker was stopped."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name}; every worker was stopped, and the checkpoints already "
            f"written are intact ({advice.how_to_resume()})."
        )
        self.exit_code = 128 + int(signum)


JOB_FAILED = "the job failed."
"""The line that opens a failed job's report (the ssh head finds each host's report by it)."""

OFFLOAD_NEEDS_GPUS = (
    "--cpu-offload moves sharded parameters, gradients and optimizer state from the GPUs to "
    "host memory; without GPUs there is nothing to offload. Drop the flag on the CPU."
)
"""Said before launch (the launcher) and at setup (a script run without it)."""


def exit_report(error: DtrainError | KeyboardInterrupt) -> tuple[str, int]:
    """(the line to print, the exit code) a command ends with on `error`: 2 for bad
    input, the workers' own code for a failed job, 128 + the signal when stopped, 1 for
    any other of dtrain's errors. Ctrl-C before the agent took over the signal counts as
    SIGINT."""
    if isinstance(error, KeyboardInterrupt):
        error = Stopped(signal.SIGINT)
    if isinstance(error, ConfigError):
        return f"error: {error}", 2
    if isinstance(error, LaunchError):
        return f"{JOB_FAILED}\n{error}", error.exit_code
    if isinstance(error, Stopped):
        return str(error), error.exit_code
    return f"error: {error}", 1
