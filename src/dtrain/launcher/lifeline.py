"""Workers die with their launcher, and a launcher killed outright leaves nothing behind.

A launcher ended by SIGKILL runs no cleanup: its workers would go on training and writing
checkpoints, unowned. Each worker asks the kernel for SIGKILL when its parent dies
(Linux's parent-death signal), and checks that the launcher did not die before it asked.
The agent's scratch folder carries the launcher's pid, so the next launch removes the
folders of launchers that are gone.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

LAUNCHER_PID = "DTRAIN_LAUNCHER_PID"
"""Environment variable: the pid of the launcher that started this worker."""
_PREFIX = "dtrain-agent-"
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """In a worker: be killed when the launcher process dies (no-op off Linux or outside
    `dtrain run`); exit at once if it is already gone."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):
        os._exit(1)  # the launcher died before the request: nobody is left to report to


def scratch_folder() -> Path:
    """A new folder for the agent's files, named after this launcher; removes the folders
    of earlier launchers that are no longer running."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{_PREFIX}*"):
        pid = old.name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
