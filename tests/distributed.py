"""The one helper every multi-process test uses.

`run_ranks(fn, world_size, *args)` starts `world_size` gloo processes on a free port
(forked from a fork server that imported torch once, each given the caller's working
directory and environment, as a spawned one would have them), runs ``fn(*args)`` in each
with RANK/WORLD_SIZE/... set as `dtrain run` sets them, and returns the results by rank.
A worker's exception fails the test with every failed rank's own traceback, tagged by
rank; a worker that hangs past `timeout` fails it too; either way every process is ended
before the helper returns.

Each job still costs seconds (process groups, the script's own imports), so a test file
runs one job per world size: a module fixture runs every check of that size one after the
other in one process group (`training.train_variants`, `habits.run_strategies`,
`test_ps.ps_runs`), and each promise keeps its own named test reading the fixture's
results. Add a new check to its file's job rather than a new `run_ranks` call.
`conftest.run_ckpt` runs `dtrain ckpt` in the test process; tests/test_cli.py keeps the
command-line path.
"""

from __future__ import annotations

import atexit
import functools
import gc
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "dtrain.engine", "dtrain.engine.start"]
"""What the fork server imports once, so that a rank starts without importing torch again
(seconds of every job); modules that read the environment when imported stay out."""


@functools.cache
def _context() -> Any:
    """The fork server's context: every rank of every job forks from one process that has
    imported `PRELOAD`, instead of starting a fresh interpreter (spawn)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: mp.Queue,
    where: tuple[str, dict[str, str]],
) -> None:
    # As a spawned process would: the caller's working directory and environment now,
    # not the fork server's from when it started.
    cwd, environ = where
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    # A fresh interpreter seeds its generators from the system; a fork would inherit the
    # server's, making every rank's unseeded draws alike.
    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    os.environ.pop("DTRAIN_CONFIG", None)
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a torch imported afterwards
    # What the fork server imported (torch, dtrain) lives as long as this process: left out
    # of every garbage collection, a gc.collect() (the Engine's close runs one) takes
    # microseconds instead of a quarter of a second.
    gc.freeze()
    try:
        # Plain pickle copies tensors; the queue's own pickler would pass shared-memory
        # handles that die with this process.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # A spawned process ends as an interpreter does, running its exit handlers (an
        # Engine left open closes there); a forked one would skip them.
        atexit._run_exitfuncs()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` ranks; return the results in rank order."""
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    where = (os.getcwd(), dict(os.environ))
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world_size, port, args, results, where), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in outcomes
                ]
                for r in dead:
                    outcomes[r] = (
                        "error",
                        f"exited with code {procs[r].exitcode} without a result",
                    )
                continue
            outcomes[rank] = (status, value)
            if status == "error":
                # The others may now wait forever in a collective; give them a moment to
                # fail on their own, then stop.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(outcomes.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        hung = f"\nrank(s) {missing} gave no result within {timeout:.0f}s" if missing else ""
        raise AssertionError("distributed test failed:\n" + "\n".join(errors) + hung)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
