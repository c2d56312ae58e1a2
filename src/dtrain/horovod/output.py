"""``horovodrun --output-filename DIR``: each rank's stdout and stderr also go to
``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` (Horovod 0.28's layout; N is zero-padded
to the width of the largest rank), while they still reach the console.

Each stream's file descriptor is pointed at a pipe read by a ``tee`` process that writes
to the file and to the original stream: everything the process and its children print,
from Python or from C, is kept, and what is still in the pipe when the process dies is
written all the same (the tee outlives it by a moment). The first attempt of a job starts
the files afresh; a restarted attempt appends, so the output of the failure stays.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dtrain.errors import ConfigError

OUTPUT_VAR = "DTRAIN_HOROVOD_OUTPUT_DIR"
"""Environment variable: the --output-filename folder the workers write to."""


def rank_folder(directory: str | Path, rank: int, size: int) -> Path:
    """``DIR/rank.N`` with N padded as Horovod pads it (``rank.07`` of 12)."""
    return Path(directory) / f"rank.{str(rank).zfill(len(str(max(size - 1, 0))))}"


def tee_streams(directory: str | Path, rank: int, size: int, fresh: bool) -> Callable[[], None]:
    """Copy this process's stdout and stderr into `rank`'s folder under `directory`
    (files emptied first when `fresh`, else appended to); return a function that puts the
    streams back and waits for the copies to finish."""
    if shutil.which("tee") is None:
        raise ConfigError(
            "--output-filename copies each rank's output with the `tee` command, which is "
            "not on PATH here; install coreutils, or drop --output-filename."
        )
    folder = rank_folder(directory, rank, size)
    folder.mkdir(parents=True, exist_ok=True)
    undo = [_tee(stream, folder / name, fresh) for stream, name in _STREAMS]

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore


_STREAMS = ((sys.stdout, "stdout"), (sys.stderr, "stderr"))


def _tee(stream: object, path: Path, fresh: bool) -> Callable[[], None]:
    fd = stream.fileno()  # type: ignore[attr-defined]
    stream.flush()  # type: ignore[attr-defined]
    original = os.dup(fd)
    command = ["tee"] if fresh else ["tee", "-a"]
    # A session of its own: the signals that stop the job's process group (Ctrl-C, the
    # agent's SIGTERM) do not cut the copy of its last lines; the tee ends when the pipe
    # closes, once this process and its children are gone.
    tee = subprocess.Popen(
        [*command, str(path)],
        stdin=subprocess.PIPE,
        stdout=original,
        close_fds=True,
        start_new_session=True,
    )
    assert tee.stdin is not None
    os.dup2(tee.stdin.fileno(), fd)
    tee.stdin.close()  # our fd is now the pipe's only write end (children inherit it)

    def undo() -> None:
        stream.flush()  # type: ignore[attr-defined]
        os.dup2(original, fd)
        os.close(original)
        try:
            tee.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a child of the script still holds the pipe
            tee.kill()

    return undo
