"""`barrier` and `join`.

Horovod's `join()` lets a process that ran out of data stop early: until every process
has joined, it keeps answering the others' all-reduces with zeros. That needs every
collective negotiated by name, which this version does not do (operations are matched by
the order they are issued). Here `join()` waits until every process has called it and
returns the rank that called it last, as Horovod's does; a process must not call it while
others still issue collectives (they would wait until the timeout). Give every process the
same number of batches instead (a DistributedSampler pads the dataset to do so).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.horovod import basics, process_sets
from dtrain.horovod.handles import issue, staged
from dtrain.horovod.process_sets import ProcessSet, global_process_set


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every process reaches this call."""
    basics.context("barrier")
    process_sets.check(process_set)
    issue(lambda: dist.barrier(), "barrier", None)


def join(device: int = -1) -> int:
    """Wait until every process has called `join()`; return the rank that called it last.

    Args:
        device: Horovod's device for its zero tensors; accepted and unused here.
    """
    ctx = basics.context("join")
    ctx.joins += 1
    # The job's store counts arrivals: the process that brings the count to a multiple of
    # size was last (a multiple, as a store kept across a re-init still holds old counts).
    store = dist.distributed_c10d._get_default_store()
    arrived = store.add(f"dtrain/horovod/join/{ctx.joins}", 1)
    last = staged(torch.tensor([ctx.rank if arrived % ctx.size == 0 else -1]), "join")
    issue(lambda: dist.all_reduce(last, op=dist.ReduceOp.MAX), "join", None)
    return int(last.item())
