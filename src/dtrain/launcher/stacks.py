"""Where each rank was when the job stopped: the stack of a hung rank, named; and the
ranks that had already finished.

When one rank fails (a collective that timed out waiting for a rank that never came, say)
the agent stops the others with SIGTERM. Each worker dumps the Python stacks of all its
threads on that signal (`faulthandler`, which runs even while the interpreter is stuck in
C code) into a file of its own, then dies as SIGTERM would kill it; the launcher reads the
files and shows where each stopped rank was, so the rank that hung is named with the line
it hung on.

A rank whose script ends while others still wait for it in a collective (it ran fewer
steps, or returned early) leaves a note of when it finished, so the report says that it
had finished rather than that it hung.

A rank stopped by SIGSTOP (a debugger, or a stopped terminal job) cannot take SIGTERM
until it runs again: the agent would wait its 30 s grace and SIGKILL it, leaving no stack.
While the agent runs, a thread of the launcher continues (SIGCONT) any of its workers that
is stopped with a SIGTERM pending, so it reports and ends at once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

STACKS_VAR = "DTRAIN_STACKS_DIR"
"""Environment variable: the folder where workers write their stacks on SIGTERM."""

_open_files: list[IO[str]] = []  # faulthandler writes to the descriptor: keep it open


def dump_on_stop() -> None:
    """In a worker: write every thread's Python stack to this rank's file on SIGTERM, then
    die of it (no-op outside `dtrain run`)."""
    folder = os.environ.get(STACKS_VAR)
    rank = os.environ.get("RANK")
    if not folder or rank is None or not Path(folder).is_dir():
        return
    file = open(Path(folder) / f"rank-{rank}.txt", "w")  # noqa: SIM115 - held open
    _open_files.append(file)
    faulthandler.register(signal.SIGTERM, file=file, all_threads=True, chain=True)


def mark_finished() -> None:
    """In a worker whose script ended without error: note when (no-op outside `dtrain
    run`)."""
    folder = os.environ.get(STACKS_VAR)
    rank = os.environ.get("RANK")
    if folder and rank is not None and Path(folder).is_dir():
        (Path(folder) / f"finished-{rank}.txt").write_text(f"{time.time():.3f}")


def read_finished(folder: Path) -> dict[int, float]:
    """When each rank that finished without error did so (seconds since the epoch)."""
    finished = {}
    for path in folder.glob("finished-*.txt"):
        with contextlib.suppress(ValueError, OSError):
            finished[int(path.stem[9:])] = float(path.read_text())
    return finished


def read_stacks(folder: Path) -> dict[int, str]:
    """The stacks the workers wrote, by rank (ranks that wrote none are left out)."""
    stacks = {}
    for path in folder.glob("rank-*.txt"):
        text = path.read_text(errors="replace").strip()
        if text and path.stem[5:].isdigit():
            stacks[int(path.stem[5:])] = text
    return stacks


def where(stack: str, frames: int = 12) -> str:
    """The thread that ran the script (the main thread, which faulthandler lists last) of
    a faulthandler dump: up to `frames` of its frames, most recent first, without the
    launcher's own frames."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip())
    _, *calls = threads[-1].splitlines()
    calls = [c for c in calls if not any(h in c for h in _HIDDEN)]
    return "\n".join(calls[:frames])


_HIDDEN = ("<frozen runpy>", "dtrain/launcher/bootstrap.py", "/runpy.py")


@contextlib.contextmanager
def stopped_workers_continued(interval_s: float = 0.2) -> Iterator[None]:
    """While inside, continue any child of this process that is stopped (SIGSTOP) with a
    SIGTERM pending, so the agent's stop takes effect at once (see the module's doc)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            for pid in _stopped_with_term_pending():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=watch, name="dtrain-continue-stopped", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _stopped_with_term_pending() -> list[int]:
    """Children of this process that are stopped and have SIGTERM pending (Linux /proc;
    elsewhere none)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces or parentheses.
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if int(ppid) != me or state not in ("T", "t"):
                continue
            status = (entry / "status").read_text()
        except (OSError, ValueError):
            continue
        pending = 0
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                pending |= int(line.split()[1], 16)
        if pending & (1 << (signal.SIGTERM - 1)):
            found.append(int(entry.name))
    return found
