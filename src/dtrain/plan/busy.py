"""A helper process that trains the planned model in a loop, so that the compute probe
of a multi-process layout on the CPU measures one process while the others compute too
(they share the cores' memory bandwidth and caches, as the ranks of the real run do).

``python -m dtrain.plan.busy BATCH THREADS SOURCE...`` prints ``ready`` once the model is
built, waits for a line ``go`` on its standard input (so that it is started early, its
imports overlapping the one-process probes, but trains only while the shared points are
timed), then trains until its standard input closes (or a minute passes).
"""

from __future__ import annotations

import sys
import threading
import time

LIMIT_SECONDS = 60.0
"""The longest a helper runs, should its parent die without closing its input."""


def main(argv: list[str]) -> None:
    """Build the workload named by `argv`, then train on it until told to stop."""
    import torch

    from dtrain.plan.source import describe_args, load_source
    from dtrain.tasks import make_optimizer

    batch, threads, *source = argv
    torch.set_num_threads(int(threads))
    work = load_source(describe_args(source))
    model = work.model
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    inputs, targets = work.batch(int(batch), torch.device("cpu"))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return  # closed before the shared points: nothing to do
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    deadline = time.monotonic() + LIMIT_SECONDS
    while not stop.is_set() and time.monotonic() < deadline:
        work.loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main(sys.argv[1:])
