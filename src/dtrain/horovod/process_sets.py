"""Horovod's process sets: subsets of the processes that run collectives among
themselves, each over a torch.distributed group of its ranks.

As in Horovod, sets are registered when every process calls ``hvd.init(process_sets=[...])``
(static sets) or, after ``hvd.init(process_sets="dynamic")`` (or with
HOROVOD_DYNAMIC_PROCESS_SETS=1), `add_process_set` and `remove_process_set`, called by every
process identically and in the same order. `global_process_set` (id 0) holds every
process. Operations take global ranks (a broadcast's root too); `ProcessSet.rank()` is a
process's position within the set, the order allgather concatenates in.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch.distributed as dist

from dtrain.horovod import basics
from dtrain.horovod.errors import HorovodUsageError, UnsupportedError

DYNAMIC_VAR = "HOROVOD_DYNAMIC_PROCESS_SETS"


class ProcessSet:
    """A set of processes, by global rank, that runs collectives together. Pass it to
    `hvd.init(process_sets=...)` or `hvd.add_process_set`; once registered its
    `process_set_id` is set and operations accept it as ``process_set=``."""

    def __init__(self, ranks: Iterable[int]) -> None:
        if not isinstance(ranks, Iterable) or isinstance(ranks, str | bytes):
            raise UnsupportedError(
                "hvd.ProcessSet takes a list of ranks; MPI communicators are not supported by "
                "dtrain (there is no MPI underneath). Pass e.g. hvd.ProcessSet([0, 2])."
            )
        values = list(ranks)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in values):
            raise HorovodUsageError(
                f"hvd.ProcessSet takes a list of integer ranks, got {values!r}; pass e.g. [0, 2]."
            )
        self.ranks: list[int] = sorted(values)
        self.process_set_id: int | None = None
        self.mpi_comm = None

    def size(self) -> int | None:
        """The number of processes in the set, or None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's position within the set (-1 outside it), or None before it is
        registered."""
        if self.process_set_id is None:
            return None
        me = basics.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """True if this process belongs to the set (None before `hvd.init`)."""
        if not basics.is_initialized():
            return None
        return basics.rank() in self.ranks

    def __repr__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"
        )


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class Registry:
    """The sets registered in this session: id -> ranks, ranks -> data process group, id ->
    the `ProcessSet` object (unregistered again at shutdown)."""

    def __init__(self, rank: int, size: int, data_group: dist.ProcessGroup, dynamic: bool) -> None:
        self.rank, self.size = rank, size
        self.dynamic = dynamic
        everyone = tuple(range(size))
        self.ranks: dict[int, tuple[int, ...]] = {0: everyone}
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {everyone: data_group}
        self.registered: dict[int, ProcessSet] = {}
        self._next_id = 1

    def group_of(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The data group of the set with these ranks."""
        return self.groups[ranks]

    def register(self, process_set: ProcessSet) -> bool:
        """Create the set's group (every process must call this alike); False, and the set
        left unregistered, if a set of the same ranks exists."""
        members = tuple(process_set.ranks)
        bad = [r for r in members if not 0 <= r < self.size]
        if not members or bad:
            raise HorovodUsageError(
                f"{process_set} names ranks outside this job of {self.size} process(es) "
                f"({bad or 'none at all'}); use ranks in [0, {self.size})."
            )
        if members in self.groups:
            return False
        self.groups[members] = dist.new_group(list(members))
        process_set.process_set_id = self._next_id
        self.ranks[self._next_id] = members
        self.registered[self._next_id] = process_set
        self._next_id += 1
        return True

    def remove(self, process_set: ProcessSet) -> bool:
        """Forget the set and destroy its group; False for the global or an unknown set."""
        ident = process_set.process_set_id
        if not ident or self.ranks.get(ident) != tuple(process_set.ranks):
            return False
        members = self.ranks.pop(ident)
        group = self.groups.pop(members)
        if self.rank in members and dist.is_initialized():
            dist.destroy_process_group(group)
        self.registered.pop(ident).process_set_id = None
        process_set.process_set_id = None
        return True

    def destroy(self) -> None:
        """Destroy every group this registry created (at `hvd.shutdown`) and unregister its
        sets: after a new `hvd.init` they are registered again, or refused by name."""
        for members, group in self.groups.items():
            if self.rank in members and dist.is_initialized():
                dist.destroy_process_group(group)
        self.groups.clear()
        for process_set in self.registered.values():
            process_set.process_set_id = None
        self.registered.clear()


def setup(registry: Registry, process_sets: Sequence[ProcessSet]) -> None:
    """Register `hvd.init`'s static sets, in order; a repeated set is left unregistered,
    as Horovod leaves it."""
    global_process_set.ranks = list(range(registry.size))
    for process_set in process_sets:
        if not isinstance(process_set, ProcessSet):
            raise HorovodUsageError(
                f'hvd.init(process_sets=...) takes a list of hvd.ProcessSet or "dynamic", got '
                f"an entry of type {type(process_set).__name__}; pass hvd.ProcessSet([ranks])."
            )
        if not registry.register(process_set):
            process_set.process_set_id = None


def dynamic_requested(process_sets: object) -> bool:
    """True for ``process_sets="dynamic"`` or HOROVOD_DYNAMIC_PROCESS_SETS=1."""
    return process_sets == "dynamic" or os.environ.get(DYNAMIC_VAR, "0") not in ("", "0")


def members(process_set: ProcessSet | None, what: str) -> tuple[int, ...]:
    """The ranks an operation on `process_set` runs over; refuse an unregistered set, or a
    set this process is not in."""
    ranks = registered(process_set, what)
    if basics.rank() not in ranks:
        raise HorovodUsageError(
            f"hvd.{what}: rank {basics.rank()} is not a member of {process_set}; only its members "
            "may run operations on it (check process_set.included() first)."
        )
    return ranks


def registered(process_set: ProcessSet | None, what: str) -> tuple[int, ...]:
    """The ranks of `process_set` (every rank for None or the global set); refuse a set
    that is not registered."""
    registry = basics.context(what).sets
    if process_set is None or process_set is global_process_set:
        return registry.ranks[0]
    if not isinstance(process_set, ProcessSet):
        raise HorovodUsageError(
            f"hvd.{what}: process_set must be an hvd.ProcessSet, got "
            f"{type(process_set).__name__}; pass hvd.global_process_set or a registered set."
        )
    ranks = registry.ranks.get(process_set.process_set_id or -1)
    if ranks != tuple(process_set.ranks):
        raise HorovodUsageError(
            f"hvd.{what}: {process_set} is not registered; pass it to hvd.init(process_sets=[...]) "
            "or register it with hvd.add_process_set() on every process first."
        )
    return ranks


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set after `hvd.init` and return it. Every process must call
    this identically and in the same order; it needs dynamic process sets
    (``hvd.init(process_sets="dynamic")`` or HOROVOD_DYNAMIC_PROCESS_SETS=1)."""
    registry = basics.context("add_process_set").sets
    if not registry.dynamic:
        raise HorovodUsageError(
            "hvd.add_process_set() needs dynamic process sets; call "
            'hvd.init(process_sets="dynamic") or set HOROVOD_DYNAMIC_PROCESS_SETS=1, or pass '
            "the sets to hvd.init(process_sets=[...]) instead."
        )
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if not registry.register(process_set):
        raise HorovodUsageError(
            f"Attempted to add a duplicate process set: {process_set} has the ranks of a set "
            "already registered; use that one (or remove it first)."
        )
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister `process_set` (every process must call this alike); return whether it
    was removed. The global set, and a set never registered, are not."""
    registry = basics.context("remove_process_set").sets
    if not registry.dynamic:
        raise HorovodUsageError(
            "hvd.remove_process_set() needs dynamic process sets; call "
            'hvd.init(process_sets="dynamic") or set HOROVOD_DYNAMIC_PROCESS_SETS=1.'
        )
    return registry.remove(process_set)
