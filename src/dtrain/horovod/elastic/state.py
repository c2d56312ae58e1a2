"""`State` and `ObjectState`: what `hvd.elastic.run` saves, restores and synchronises.

As in Horovod, `commit()` saves the state in memory (`save`), `restore()` goes back to
the last save, and `sync()` gives every process rank 0's state. dtrain recovers from a
lost process by restarting the whole worker group rather than in the surviving processes,
so `commit()` also writes the saved state to the job's elastic folder (`durable.py`),
from which the restarted processes start again.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

from dtrain.horovod import basics
from dtrain.horovod.elastic import durable
from dtrain.horovod.functions import broadcast_object

_numbers = itertools.count()
"""Numbers the states a script makes, in order, so a restarted script finds each one's file."""


class State:
    """What training keeps across a failure: subclasses say how to save, restore and sync.

    Args:
        bcast_object: Broadcasts a picklable object from a root to every process
            (Horovod's signature; default `hvd.broadcast_object`).
        get_rank: Returns this process's rank (default `hvd.rank`).
    """

    def __init__(
        self,
        bcast_object: Callable[..., Any] | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or basics.rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._number = next(_numbers)
        self._commits = 0
        self._looked_for_commit = False

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Run `callbacks` after every reset: on dtrain, when a restarted worker group takes
        up a committed state (for example to scale the learning rate to the new
        `hvd.size()`)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called after a reset, before the state is synchronised: `reset()`, then the
        registered callbacks in order."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (in memory, and, under a launcher, to the job's elastic folder
        for a restarted group), then check for host changes (none arrive in-process on
        dtrain). Commits copy the whole state: commit every few batches, not every one."""
        self.save()
        self._commits += 1
        durable.write(self._number, self._commits, self.snapshot())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises `HostsUpdatedInterrupt` here when hosts were added or removed.
        On dtrain a change of hosts restarts the worker group instead, so this returns."""

    def save(self) -> None:
        """Save the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved state, undoing what came after it."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every process rank 0's state."""
        self.sync_from(0)

    def sync_from(self, root_rank: int) -> None:
        """Give every process `root_rank`'s state (dtrain: the process holding the newest
        commit when a restarted group starts)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust objects after a reset, before the state is synchronised (default: nothing)."""

    def snapshot(self) -> dict[str, Any]:
        """The last saved state as one picklable dict (what a commit writes to disk)."""
        raise NotImplementedError

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Make `snapshot` (from `snapshot()`, maybe of another process) the saved state and
        restore it."""
        raise NotImplementedError

    def count_commits_from(self, number: int) -> None:
        """Number this state's next commit after `number` (the job's newest commit)."""
        self._commits = number

    def resume(self) -> durable.Commit | None:
        """Restore this state from its last commit in the job's elastic folder, if any, and
        return that commit (None: nothing committed yet; nothing changed). Only the first
        call in a process looks: later ones (the function run again) return None."""
        if self._looked_for_commit:
            return None
        self._looked_for_commit = True
        found = durable.read(self._number)
        if found is not None:
            self._commits = found.number
            self.load_snapshot(found.snapshot)
        return found


class ObjectState(State):
    """Plain Python values, given as keyword arguments and kept as attributes
    (``state.epoch``, ``state.batch``); they must be picklable.

    Args:
        bcast_object, get_rank: as for `State` (Horovod passes them; defaults are hvd's).
        **kwargs: the values, e.g. ``ObjectState(epoch=0, batch=0)``.
    """

    def __init__(
        self,
        bcast_object: Callable[..., Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Remember the current value of every attribute given at construction."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        """Set every attribute back to its saved value."""
        self._set_attrs()

    def sync_from(self, root_rank: int) -> None:
        """Every process takes `root_rank`'s saved values (Horovod broadcasts the saved
        values, not the live attributes)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root_rank)
            self._set_attrs()

    def snapshot(self) -> dict[str, Any]:
        """The saved values."""
        return {"objects": self._saved_state}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Take the values of `snapshot` (names this state does not know are dropped)."""
        saved = snapshot.get("objects", {})
        self._saved_state = {k: saved.get(k, v) for k, v in self._saved_state.items()}
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
