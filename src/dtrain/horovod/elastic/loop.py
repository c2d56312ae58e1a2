"""`hvd.elastic.run`: the decorator around an elastic training function.

Horovod recovers in the surviving processes: on `HorovodInternalError` they restore the
last commit, form a new group and call the function again. dtrain recovers by restarting
the worker group (torch's elastic agent, `horovodrun --min-np/--max-np` or `dtrain run
--max-restarts`): here a lost peer ends this process with one line of explanation, and on
entry a restarted process takes up the newest commit the last group wrote.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from dtrain.horovod import basics
from dtrain.horovod.elastic.state import State
from dtrain.horovod.errors import (
    HorovodInternalError,
    HorovodUsageError,
    HostsUpdatedInterrupt,
    PeerLostError,
)
from dtrain.horovod.functions import allgather_object

Result = TypeVar("Result")


def _take_up_commit(state: State) -> None:
    """Restore the newest commit any process finds, give it to everyone, then run the
    reset callbacks (a restarted group is a reset); without one, sync rank 0's state."""
    found = state.resume()
    numbers = [-1 if found is None else found.number]
    if basics.size() > 1:
        # Under -H every machine reads its own copy; one that joined later may have none.
        numbers = allgather_object(numbers[0])
    newest = max(numbers)
    if newest < 0:
        state.sync()
        return
    # Every process counts on from the newest commit, with or without a copy of its own, so
    # that a machine holding an older copy never outnumbers the others' later commits.
    state.count_commits_from(newest)
    root = numbers.index(newest)
    state.on_reset()
    state.sync_from(root)
    if basics.rank() == root:
        assert found is not None
        print(
            f"hvd.elastic: resumed from commit {newest} (written at world size "
            f"{found.world_size}; now {basics.size()}).",
            file=sys.stderr,
            flush=True,
        )


def _lost_peer(error: BaseException) -> PeerLostError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return PeerLostError(
        f"hvd.elastic.run: rank {basics.rank()} lost the group ({first}); this process "
        "ends so that the launcher restarts the worker group, which resumes from the last "
        "commit (restarts: horovodrun --min-np/--max-np/--reset-limit, or dtrain run "
        "--max-restarts)."
    )


def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorate an elastic training function ``func(state, *args, **kwargs)``.

    On entry the state takes up the newest commit of the job, if a restarted group finds
    one (then the reset callbacks run), and every process takes the root's state
    (`state.sync()`); then `func` runs. When a collective fails inside it
    (`HorovodInternalError`: a peer died), or `HostsUpdatedInterrupt` is raised, this
    process prints one line and exits with code 1, and the launcher restarts the group.
    As in Horovod, `func` must not begin with a collective of its own before it reads
    `state`.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Result:
        try:
            _take_up_commit(state)  # collective: a peer may be lost here too
            return func(state, *args, **kwargs)
        except HorovodUsageError:
            raise  # processes disagreeing about an operation: a bug, not a lost peer
        except (HorovodInternalError, HostsUpdatedInterrupt) as e:
            lost = _lost_peer(e)
            print(str(lost), file=sys.stderr, flush=True)
            raise lost from None

    return wrapper
