"""A trial's process tree, seen from outside through Linux's /proc: every rank's peak
resident memory, and the processes to stop when a trial runs out of time.

The launcher starts its workers in sessions of their own (the elastic agent does), so a
trial cannot be stopped by signalling one process group; and the metrics JSON carries no
per-rank peak memory. Both are found by walking the tree below the trial's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import defaultdict
from pathlib import Path

PROC = Path("/proc")


def available() -> bool:
    """True where /proc describes processes (Linux); elsewhere nothing here measures."""
    return (PROC / "self" / "status").is_file()


def descendants(root: int) -> dict[int, int]:
    """`root` and every process below it, parents before their children, each with its
    start time (clock ticks since boot), which tells it from a later process given the
    same id."""
    children: dict[int, list[int]] = defaultdict(list)
    started: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = _stat(pid)
        if fields is None:
            continue  # it ended while we looked
        children[int(fields[1])].append(pid)
        started[pid] = int(fields[19])
    order: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in started:
            order[pid] = started[pid]
            todo.extend(children.get(pid, ()))
    return order


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from the third (state) on: ppid is [1], the start time
    [19]; None once the process has ended."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat.rsplit(")", 1)[1].split()


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
        environ = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"RANK="):
            value = item[5:].decode(errors="replace")
            return int(value) if value.isdigit() else None
    return None


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
        self.seen: dict[int, int] = {}
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


def kill_tree(tree: dict[int, int]) -> None:
    """SIGKILL each process of `tree` (pid -> start time, from `descendants`) still alive;
    a process that now holds one of the ids but started at another time is left alone."""
    for pid, started in tree.items():
        fields = _stat(pid)
        if fields is None or int(fields[19]) != started:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
