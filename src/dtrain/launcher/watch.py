"""Elastic jobs: a machine that loses the rendezvous host stops within --timeout.

torch's agent talks to the rendezvous store over one TCP connection with blocking reads.
When the host dies outright its kernel resets that connection and the agent fails at
once; but when the host's link goes down (a cable, a switch, a frozen machine) nothing
answers and nothing resets, and the agent's next read waits for TCP to give up, many
minutes later, its heartbeat thread holding a lock the main thread then waits on too.
So each machine that does not host the rendezvous opens a fresh connection to it every
second on the side; once none has succeeded for --timeout, it reports the host lost and
exits, and its workers, bound to it by the parent-death signal (`lifeline`), go with it.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dtrain.errors import JOB_FAILED

PROBE_EVERY_S = 1.0


def _reachable(address: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _watch(
    address: str, port: int, timeout_s: float, on_lost: Callable[[], None], done: threading.Event
) -> None:
    last_seen = time.monotonic()
    while not done.wait(PROBE_EVERY_S):
        if _reachable(address, port, PROBE_EVERY_S):
            last_seen = time.monotonic()
        elif time.monotonic() - last_seen >= timeout_s and not done.is_set():
            on_lost()
            return


@contextmanager
def rendezvous_host_watched(
    endpoint: str, timeout_s: float, message: Callable[[], str]
) -> Iterator[None]:
    """While the block runs, check every second that ``ADDRESS:PORT`` `endpoint` accepts
    connections; after `timeout_s` seconds without one, print ``dtrain: the job failed.``
    and `message()` and end this process with exit code 1 (its workers die with it)."""
    address, port = endpoint.rsplit(":", 1)
    done = threading.Event()

    def lost() -> None:
        print(f"dtrain: {JOB_FAILED}\n{message()}", file=sys.stderr, flush=True)
        os._exit(1)  # the agent's main thread is stuck in a read that nothing can interrupt

    watcher = threading.Thread(
        target=_watch,
        args=(address, int(port), timeout_s, lost, done),
        name="dtrain-rendezvous-watch",
        daemon=True,
    )
    watcher.start()
    try:
        yield
    finally:
        done.set()
