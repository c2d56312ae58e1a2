"""Horovod's process sets, as far as this version goes: the global set (every process),
which every collective takes by default. Creating other sets is refused with a message."""

from __future__ import annotations

from collections.abc import Sequence

from dtrain.horovod import basics
from dtrain.horovod.errors import UnsupportedError

_NOT_YET = (
    "Process sets other than the global one are not supported yet; drop the process_set "
    "argument so the operation runs over all processes."
)


class ProcessSet:
    """A set of ranks that runs collectives together; only the global set (``ranks=None``,
    every process) can be used in this version."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def _is_global(self) -> bool:
        return self.ranks is None or self.ranks == list(range(basics.size()))

    def size(self) -> int:
        """The number of processes in the set."""
        return basics.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set."""
        me = basics.rank()
        return me if self.ranks is None else self.ranks.index(me)

    def included(self) -> bool:
        """True if this process belongs to the set."""
        return self.ranks is None or basics.rank() in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def check(process_set: ProcessSet | None) -> None:
    """Refuse any process set but the global one (or one naming every rank)."""
    if process_set is None or process_set is global_process_set:
        return
    if not isinstance(process_set, ProcessSet) or not process_set._is_global():
        raise UnsupportedError(_NOT_YET)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Refused in this version: every collective runs over all processes."""
    raise UnsupportedError(_NOT_YET)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Refused in this version: there is only the global process set."""
    raise UnsupportedError(_NOT_YET)
