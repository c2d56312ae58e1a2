"""One run per output folder: a lock file (``DIR/dtrain.lock``) naming the run that holds
the folder, taken before the run writes or deletes anything there and removed when it ends.

Two runs saving into one folder interleave their checkpoints, prune each other's, and a
later resume continues whichever saved last; a check for existing checkpoints at start
cannot see a run that started a moment earlier. The lock is a file written beside its
place and hard-linked into it, which fails if one is already there (on every filesystem,
network ones included), so of two takers exactly one wins, and a reader never finds a
half-written lock. It names its owner (host, pid, start time) as JSON. A lock whose owner
is gone from this host is stale and taken over with a note; dtrain cannot tell whether a
process of another host is alive, so that host's lock is refused with the file's path.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrain.errors import ConfigError

LOCK_NAME = "dtrain.lock"
"""The lock's file name inside the folder it holds."""
ATTEMPTS = 5
"""Tries at taking the lock: another taker may remove or take over a lock between the
tries; each try either takes it, refuses it, or clears a stale one."""


@dataclass(frozen=True)
class Owner:
    """The process holding a folder: where it runs, its pid, when it took the lock
    (local time, for people) and its start in clock ticks after boot (field 22 of
    /proc/PID/stat, None where unreadable), which tells a reused pid from the owner."""

    host: str
    pid: int
    started: str
    ticks: int | None
    job: str | None = None
    """The job it launches a part of, where several machines run one (its rendezvous
    endpoint, --master): every machine of that job writes to the folder as one run."""

    def describe(self) -> str:
        """The owner in words, as messages name it."""
        return f"pid {self.pid} on host {self.host}, started {self.started}"


class OutLock:
    """A folder's lock, held by this process until :meth:`release` (or the end of a
    ``with`` block over it)."""

    def __init__(self, path: Path, owner: Owner, shared: bool = False) -> None:
        self.path = path
        self.owner = owner
        self.shared = shared
        """True if another machine of this job holds the lock (`owner`): left to it."""

    def release(self) -> None:
        """Remove the lock if it still names this process (one deleted by hand and taken
        by another run meanwhile is that run's, and stays)."""
        if not self.shared and _read(self.path) == self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def this_process(job: str | None = None) -> Owner:
    """This process, launching a part of `job` (None: a job of this machine alone), as a
    lock names it."""
    return Owner(
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        ticks=_start_ticks(os.getpid()),
        job=job,
    )


def take(directory: Path, job: str | None = None) -> OutLock:
    """Lock `directory` (created if missing) for this process, launching a part of the
    multi-machine `job` (its --master; None for a job of one machine); raise ConfigError
    naming the run that holds it. A lock another machine of the same job holds is shared.
    A stale lock (its process gone from this host) is taken over with a note on stderr
    naming its owner."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    owner = this_process(job)
    for _ in range(ATTEMPTS):
        if _place(path, owner):
            return OutLock(path, owner)
        holder = _read(path)
        if holder is None:
            continue  # released between the two looks: try again
        if job is not None and holder.job == job:
            return OutLock(path, holder, shared=True)
        _refuse_unless_stale(directory, path, holder)
        if _remove_if_unchanged(path, holder):
            print(
                f"dtrain: taking over {path}, left by a run that is gone ({holder.describe()}).",
                file=sys.stderr,
                flush=True,
            )
    raise ConfigError(
        f"Other dtrain runs kept taking {path} while this one tried {ATTEMPTS} times; start "
        "one run per folder, or choose another --out."
    )


def _place(path: Path, owner: Owner) -> bool:
    """Create the lock at `path` naming `owner`, whole and at once; False if one is
    there already."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(asdict(owner), file)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: create it exclusively instead
            return _create_exclusively(path, owner)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _create_exclusively(path: Path, owner: Owner) -> bool:
    """Create `path` with O_EXCL and write `owner` in one write; False if it exists.
    A taker reading it before the write sees no owner, and is refused as unreadable."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(json.dumps(asdict(owner)))
    return True


def _read(path: Path) -> Owner | None:
    """The owner the lock at `path` names; None if there is none. Raise ConfigError for
    a file that names no owner."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unreadable(path, e.strerror or str(e)) from None
    try:
        fields = json.loads(text)
        owner = Owner(
            str(fields["host"]),
            int(fields["pid"]),
            str(fields["started"]),
            fields["ticks"],
            fields.get("job"),
        )
    except (ValueError, TypeError, KeyError) as e:
        raise _unreadable(path, f"{type(e).__name__}: {e}") from None
    if owner.pid <= 0 or not (owner.ticks is None or isinstance(owner.ticks, int)):
        raise _unreadable(path, "its pid or start is not a process's")
    return owner


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} is not a dtrain lock this run can read ({why}); another run may be just "
        f"starting in {path.parent}. If no run uses that folder, delete {path} by hand and "
        "start again; otherwise choose another --out."
    )


def _refuse_unless_stale(directory: Path, path: Path, holder: Owner) -> None:
    """Raise ConfigError naming `holder` unless it is a process of this host that is gone."""
    here = socket.gethostname()
    if holder.host != here:
        raise ConfigError(
            f"{directory} is in use by a dtrain run on host {holder.host} (pid {holder.pid}, "
            f"started {holder.started}), and dtrain cannot tell from {here} whether it is "
            f"still running. Choose another --out; or, if that run is gone, delete {path} "
            "by hand and start again."
        )
    if _alive(holder):
        raise ConfigError(
            f"{directory} is in use by another dtrain run ({holder.describe()}). Wait for it "
            "to finish, or choose another --out (--overwrite does not stop a running run)."
        )


def _alive(owner: Owner) -> bool:
    """Whether the process `owner` names (on this host) is still running: its pid is, and
    where both starts can be read, it is the same process, not a later one given its pid."""
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    now = _start_ticks(owner.pid)
    return owner.ticks is None or now is None or now == owner.ticks


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (Linux); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces; field 22 is the
    # 20th after it
    return int(stat.rsplit(")", 1)[1].split()[19])


def _remove_if_unchanged(path: Path, stale: Owner) -> bool:
    """Delete the lock at `path` if it still names `stale`. Moved aside first, so that
    of two runs clearing the same stale lock one cannot delete the lock the other has
    just taken: a fresh lock moved aside by mistake is put back."""
    aside = path.with_name(f".{path.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        try:
            unchanged = _read(aside) == stale
        except ConfigError:  # a lock still being written: another taker's, put back
            unchanged = False
        if not unchanged:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
        return unchanged
    finally:
        aside.unlink()
