"""Safe teardown whether or not the script calls `engine.close()`.

A DDP or FSDP object still alive when the process group is destroyed, or when the
interpreter exits, can abort the process on gloo ("terminate called without an active
exception", SIGABRT) after all the work is done. So every Engine is closed before the
interpreter finalises (an exit handler), and a worker started by `dtrain run` leaves with
`os._exit` once its engines are closed and its output flushed, skipping the destructors
that race with the process group's.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import weakref
from typing import Protocol


class Closable(Protocol):
    """What the registry closes (an Engine)."""

    def close(self, *, failed: bool = False) -> None: ...


_OPEN: weakref.WeakSet[Closable] = weakref.WeakSet()


def close_at_exit(engine: Closable) -> None:
    """Close `engine` at exit if the script does not."""
    _OPEN.add(engine)


def forget(engine: Closable) -> None:
    """`engine` was closed by its owner."""
    _OPEN.discard(engine)


def forget_all() -> None:
    """Leave every open Engine to its owner (a forked child must not close the parent's)."""
    _OPEN.clear()


def close_all(failed: bool | None = None) -> None:
    """Close every Engine still open, newest first. `failed`: the process ends on an error
    (at interpreter exit: an exception nobody caught), so the other ranks may not reach
    the collectives a normal close runs."""
    if failed is None:
        failed = hasattr(sys, "last_value")  # set when an uncaught exception was printed
    for engine in reversed(list(_OPEN)):
        engine.close(failed=failed)


def exit_now(code: int) -> None:
    """Close what is open, flush every output, and end the process with `code` at once."""
    try:
        close_all(failed=code != 0)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to flush
                stream.flush()
        os._exit(code)


atexit.register(close_all)
