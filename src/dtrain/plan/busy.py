"""A helper process that trains the planned model in a loop, so that the compute probe
of a multi-process layout on the CPU measures one rank while the others train too, in
lockstep with it (`dtrain.plan.lockstep`): they share the cores' memory bandwidth and
caches, and wait for each other once a step, as the ranks of the real run do.

``python -m dtrain.plan.busy BATCH THREADS HOST:PORT RANK WORLD SOURCE...`` prints
``ready`` once the model is built, waits for a line ``go`` on its standard input (so that
it is started early, its imports overlapping the one-process probes, but trains only while
the shared points are timed), joins the probe's group as RANK of WORLD, and trains, each
step ending with the group's all-reduce, at the batch the planner's word names (BATCH at
first) until the word says leave; then it trains on its own at the last batch until its
standard input closes (or a minute passes).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

LIMIT_SECONDS = 60.0
"""The longest a helper runs, should its parent die without closing its input."""


def main(argv: list[str]) -> None:
    """Build the workload named by `argv`, then train on it until told to stop."""
    import torch
    import torch.distributed as dist

    from dtrain.models.recipes import make_optimizer
    from dtrain.plan.engine_probe import endless_batches
    from dtrain.plan.lockstep import LEAVE, TIMEOUT, Lockstep
    from dtrain.plan.source import describe_args, load_source

    first, threads, address, rank, world, *source = argv
    torch.set_num_threads(int(threads))
    work = load_source(describe_args(source))
    model = work.model
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    batches: dict[int, tuple[Any, Iterator[object]]] = {}

    def step(batch: int) -> None:
        """One step at `batch` samples: load a batch, forward, backward, optimizer."""
        if batch not in batches:
            batches[batch] = (work.batch(batch, torch.device("cpu")), endless_batches(work, batch))
        (inputs, targets), loads = batches[batch]
        next(loads)
        work.loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(int(first))  # builds the first batch's loader before the probe starts
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return  # closed before the shared points: nothing to do
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), int(world), is_master=False, timeout=TIMEOUT)
    lockstep: Lockstep | None = Lockstep(store, int(rank), int(world))
    batch = int(first)
    deadline = time.monotonic() + LIMIT_SECONDS
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            step(batch)
            if lockstep is not None:
                word = lockstep.sync(0)
                if word == LEAVE:
                    lockstep = None
                else:
                    batch = word  # the planner's batch: compute alike, wait for no one
    except RuntimeError:  # the planner is gone (the group timed out): nothing to do
        return


if __name__ == "__main__":
    main(sys.argv[1:])
