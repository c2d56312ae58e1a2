"""The ranks of a multi-process layout in lockstep: helper processes and a group with them.

A rank of a synchronous job computes, then waits for the other ranks at every collective
or hand-over. On the CPU that wait is not free: the ranks arrive at different times, a
blocked rank gives up its core and is woken later, and the compute right after a wait runs
slower than back to back (cold caches, a thread moved to the other core). A compute probe
alone, or beside helpers that train on their own, misses all of it; on a small model it
was most of the step (the planner predicted a 2-process step 2 to 3 times too short).

So the shared points are timed in lockstep: this process and `count` helper processes
(`dtrain.plan.busy`) form a gloo group of their own (a store on a free loopback port; no
default group, so nothing else in this process sees it), and every probed step, theirs
and ours, ends with a one-element all-reduce, the least synchronization a step of a
synchronous layout has. Its time is the cost of one synchronization in lockstep
(`StepTime.sync`), the compute around it is timed as the real ranks run it.

The all-reduced value (a sum: the helpers add 0) also carries this process's word to
the helpers: the batch its step ran, which they take for their next step, so that the
ranks compute alike and the all-reduce waits for no rank's larger batch; 0 to leave the
lockstep (they then train on their own until their standard input closes, so that the
torch wrappers' overheads are still timed beside them).
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.plan.source import Source

TIMEOUT = timedelta(seconds=60)
"""The longest any process of the probe waits for another (a helper that died)."""
LEAVE = 0
"""The word that ends the lockstep (any other is the batch to run next)."""


class Lockstep:
    """One process's side of the probe's group (rank 0 is the planner)."""

    def __init__(self, store: dist.Store, rank: int, world: int) -> None:
        self.group = dist.ProcessGroupGloo(store, rank, world, TIMEOUT)
        self._word = torch.zeros(1)

    def sync(self, word: int = LEAVE) -> int:
        """All-reduce `word` with the other processes (they send 0, rank 0 its word);
        rank 0's word."""
        self._word.fill_(word)
        self.group.allreduce([self._word]).wait()
        return int(self._word.item())


class Helpers:
    """`count` helper processes that train the planned model at `batch` and `threads`,
    started early (their imports overlap the one-process probes), idle until `go`."""

    def __init__(self, source: Source, batch: int, threads: int, count: int) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, count + 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False
        )
        self.world = count + 1
        address = f"127.0.0.1:{self.store.port}"
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dtrain.plan.busy",
                    str(batch),
                    str(threads),
                    address,
                    str(rank),
                    str(self.world),
                    *source.args(),
                ],  # fmt: skip
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(1, self.world)
        ]

    def wait_ready(self) -> None:
        """Wait until every helper has built its model (and is idle, waiting for `go`)."""
        for helper in self.processes:
            assert helper.stdout is not None
            if helper.stdout.readline().strip() != "ready":
                raise RuntimeError("a compute-probe helper process failed to start")

    def go(self) -> Lockstep:
        """Let every helper train, in lockstep with this process (rank 0)."""
        for helper in self.processes:
            assert helper.stdin is not None
            helper.stdin.write("go\n")
            helper.stdin.flush()
        return Lockstep(self.store, 0, self.world)

    def stop(self) -> None:
        """Close the helpers' input (they stop) and wait for them."""
        for helper in self.processes:
            assert helper.stdin is not None
            helper.stdin.close()
        for helper in self.processes:
            try:
                helper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
