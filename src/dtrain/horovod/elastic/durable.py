"""The job's elastic folder: where `state.commit()` leaves the committed state for a
restarted worker group.

Horovod keeps committed state in the memory of the processes that survive a failure.
dtrain restarts every process of the group instead, so each commit is also written to a
folder the restarted processes find: ``DTRAIN_ELASTIC_DIR`` (``horovodrun`` sets it to a
folder of its own for each job and removes it at the end), else, under dtrain's
launcher, ``<tmp>/dtrain-elastic-<token>`` (a token the launcher draws for each job, the
same for every restart of it, so a later job never takes up an earlier one's commits);
without a launcher there is no folder and commits stay in memory.

The first process of each machine (local rank 0) writes ``state-<n>.pt`` (n numbers the
states a script creates) to a temporary name and renames it, so a reader never sees half
a file, whatever moment a process dies at.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.horovod import basics

DIR_VAR = "DTRAIN_ELASTIC_DIR"
"""Environment variable: the folder commits are written to (see the module docstring)."""
_TOKEN_VAR = "DTRAIN_JOB_TOKEN"
"""Set by dtrain's launcher (`dtrain.launcher.runner.JOB_TOKEN`)."""


def folder() -> Path | None:
    """This job's elastic folder, or None when commits stay in memory (no launcher)."""
    chosen = os.environ.get(DIR_VAR)
    if chosen:
        return Path(chosen)
    token = os.environ.get(_TOKEN_VAR)
    if token:
        return Path(tempfile.gettempdir()) / f"dtrain-elastic-{token}"
    return None


def _file(number: int) -> Path | None:
    where = folder()
    return None if where is None else where / f"state-{number}.pt"


def write(number: int, commit: int, snapshot: dict[str, Any]) -> None:
    """Write commit `commit` of state `number` (local rank 0 of each machine; no-op
    without a folder)."""
    path = _file(number)
    if path is None or basics.local_rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"commit": commit, "world_size": basics.size(), "snapshot": snapshot}
    # A name of this machine and process: on a shared folder several machines write.
    partial = path.with_name(f".{path.name}.{os.uname().nodename}.{os.getpid()}")
    torch.save(payload, partial)
    os.replace(partial, path)


@dataclass(frozen=True)
class Commit:
    """A commit found in the elastic folder."""

    number: int
    world_size: int
    snapshot: dict[str, Any]


def read(number: int) -> Commit | None:
    """The last commit of state `number`, or None."""
    path = _file(number)
    if path is None or not path.is_file():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return Commit(int(payload["commit"]), int(payload["world_size"]), payload["snapshot"])
