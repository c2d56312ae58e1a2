"""Run a program that is not a Python script under `horovodrun` (a shell script, `pytest`,
`python -c ...`): a child process of the worker, which has already exported Horovod's
and torch's variables, so the program and anything it starts sees them.

The child dies with the worker (the kernel's parent-death signal), the worker forwards
the launcher's SIGTERM and SIGINT to it, and its exit code is the worker's. Its output
goes through the worker's own streams, so ``--output-filename`` copies it too.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
from typing import IO

_PR_SET_PDEATHSIG = 1


def run_command(program: str, args: list[str]) -> int:
    """Run `program` with `args`; return its exit code (128 + N if a signal N ended it)."""
    child = subprocess.Popen(
        [program, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    previous = {
        s: signal.signal(s, lambda signum, _: child.send_signal(signum))
        for s in (signal.SIGTERM, signal.SIGINT)
    }
    copies = [
        threading.Thread(target=_copy, args=(child.stdout, sys.stdout), daemon=True),
        threading.Thread(target=_copy, args=(child.stderr, sys.stderr), daemon=True),
    ]
    for copy in copies:
        copy.start()
    try:
        code = child.wait()
        for copy in copies:
            copy.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code


def _copy(source: IO[bytes] | None, target: IO[str]) -> None:
    """Copy the child's output, line by line as it comes, to one of the worker's streams."""
    assert source is not None
    for line in iter(source.readline, b""):
        target.write(line.decode(errors="replace"))
        target.flush()


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the worker dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
