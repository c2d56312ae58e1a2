"""`barrier` and `join`, both decided by the negotiation alone (no data moves).

`join()` lets a process that ran out of data stop early, as Horovod's does: it blocks until
every process has joined, and meanwhile the negotiation counts the joined process as
present for every all-reduce the others issue, in which it takes part with zeros. An
`Average` still divides by the size of the process set, joined processes included.
Operations other than all-reduce cannot run while a member has joined (an error on every
process, as in Horovod). `join()` returns the rank that joined last.
"""

from __future__ import annotations

import torch

from dtrain.horovod import basics
from dtrain.horovod.handles import submit
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.requests import BARRIER, JOIN


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every process of `process_set` reaches this call."""
    submit(BARRIER, "barrier", None, [], process_set, "barrier").wait()


def join(device: int = -1) -> int:
    """Declare that this process has no more data; block until every process has joined,
    taking part with zeros in the all-reduces the others issue meanwhile. Returns the rank
    that joined last.

    Args:
        device: the GPU on which the zeros are made for CUDA all-reduces (-1: the current
            one); CPU all-reduces use the CPU.
    """
    ctx = basics.context("join")
    if device < 0 and torch.cuda.is_available():
        # The negotiation thread's current GPU is not the one the script pinned.
        device = torch.cuda.current_device()
    ctx.executor.join_device = device
    return submit(JOIN, "join", "join", [], None, "join").wait()
