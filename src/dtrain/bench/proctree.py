"""A trial's process tree, seen from outside: every rank's peak resident memory, and the
processes to stop when a trial runs out of time.

The launcher starts its workers in sessions of their own (the elastic agent does), so a
trial cannot be stopped by signalling one process group; and the metrics JSON carries no
per-rank peak memory. Both are found by walking the tree below the trial's process with
psutil; the peak itself (VmHWM) only Linux's /proc keeps.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import psutil

PROC = Path("/proc")

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def available() -> bool:
    """True where /proc keeps each process's peak memory (Linux); elsewhere nothing here
    measures."""
    return (PROC / "self" / "status").is_file()


def descendants(root: int) -> dict[int, float]:
    """`root` and every process below it, parents before their children, each with its
    creation time, which tells it from a later process given the same id."""
    try:
        top = psutil.Process(root)
        tree = [top, *top.children(recursive=True)]
    except _GONE:
        return {}
    found: dict[int, float] = {}
    for process in tree:
        with contextlib.suppress(*_GONE):  # it ended while we looked
            found[process.pid] = process.create_time()
    return found


def _peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (VmHWM), or None once it has ended."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rank_of(pid: int) -> int | None:
    """The RANK in the environment the process started with (launched workers have it)."""
    try:
        value = psutil.Process(pid).environ().get("RANK", "")
    except _GONE:
        return None
    return int(value) if value.isdigit() else None


class PeakMemory:
    """Polls the tree below `root` every `interval` seconds in a thread and keeps each
    process's peak resident memory; `stop` returns it per rank.

    The peak (VmHWM) never falls, so a poll that comes late still sees it; only growth in
    the last `interval` before a process exits can be missed.
    """

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root = root
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.ranks: dict[int, int | None] = {}
        self.seen: dict[int, float] = {}
        """Every process of the tree seen so far, with its start time."""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> PeakMemory:
        """Begin polling; returns self."""
        self._thread.start()
        return self

    def _poll(self) -> None:
        while True:
            self.sample()
            if self._done.wait(self.interval):
                return

    def sample(self) -> None:
        """Read the peak of every process in the tree once."""
        tree = descendants(self.root)
        self.seen.update(tree)
        for pid in tree:
            peak = _peak_rss_bytes(pid)
            if peak is None:
                continue
            if pid not in self.ranks:
                self.ranks[pid] = _rank_of(pid)
            self.peaks[pid] = max(peak, self.peaks.get(pid, 0))

    def stop(self) -> list[int | None] | None:
        """Stop polling; the peak bytes of each rank in rank order (None for a rank never
        seen), or None if no process was seen. A job that ran in the launcher's own process
        (one process) is rank 0."""
        self._done.set()
        self._thread.join()
        by_rank: dict[int, int] = {}
        for pid, peak in self.peaks.items():
            rank = self.ranks.get(pid)
            if rank is not None:
                by_rank[rank] = max(peak, by_rank.get(rank, 0))
        if not by_rank and self.root in self.peaks:
            by_rank[0] = self.peaks[self.root]
        if not by_rank:
            return None
        return [by_rank.get(rank) for rank in range(max(by_rank) + 1)]


def kill_tree(tree: dict[int, float]) -> None:
    """SIGKILL each process of `tree` (pid -> creation time, from `descendants`) still
    alive; a process that now holds one of the ids but was created at another time is left
    alone."""
    for pid, created in tree.items():
        with contextlib.suppress(*_GONE):
            process = psutil.Process(pid)
            if process.create_time() == created:
                process.kill()
