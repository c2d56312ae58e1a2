"""All-gather, Horovod's way: every process's tensor concatenated along the first
dimension, which may differ from process to process (`allgather`, `allgather_async`,
`grouped_allgather`, `grouped_allgather_async`), and the sparse all-reduce built on it
(`sparse_allreduce_async`: indices and values gathered, not summed densely).

The negotiation carries every process's shapes, so the sizes are known when the gather
starts (mismatched dtypes or trailing dimensions are reported by every process instead);
each tensor is padded to the largest first dimension, gathered, and the padding cut away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allreduce import needs_grad
from dtrain.horovod.allreduce import start as start_allreduce
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, submit
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, resolve
from dtrain.horovod.requests import ALLGATHER


def start(
    tensors: Sequence[torch.Tensor],
    what: str,
    name: str | None,
    process_set: ProcessSet | None = None,
    prefix: str = "allgather",
) -> Operation:
    """Queue gathering each of `tensors`; the operation's result is (the gathered tensors,
    each tensor's first dimension on every member: rows[i][member])."""
    for t in tensors:
        if t.dim() == 0:
            raise HorovodUsageError(
                f"hvd.{what} concatenates along the first dimension, so it needs tensors of "
                "at least one dimension, got a scalar; pass tensor.reshape(1)."
            )
    return submit(ALLGATHER, prefix, name, [t.detach() for t in tensors], process_set, what)


class _Allgather(torch.autograd.Function):
    """All-gather of one or more tensors whose gradients are this process's rows of the
    averaged incoming gradients, as in Horovod."""

    @staticmethod
    def forward(ctx: Any, name: str | None, ps, prefix: str, *tensors: torch.Tensor):  # type: ignore[override]
        gathered, rows = start(list(tensors), prefix, name, ps, prefix).wait()
        ctx.rows, ctx.ps, ctx.prefix = rows, ps, prefix
        return tuple(gathered)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        # The all-reduce is grouped as the gather was, so a grouped gather's gradients
        # take one negotiated operation, named as Horovod's backward names it.
        prefix = "allreduce" if ctx.prefix == "allgather" else "grouped_allreduce"
        fresh = [g.detach().clone() for g in grads]
        average = ReduceOp.Average
        reduced = start_allreduce(fresh, average, 1.0, 1.0, ctx.prefix, None, ctx.ps, prefix)
        me = process_sets.members(ctx.ps, ctx.prefix).index(basics.rank())
        mine = [
            g.narrow(0, sum(rows[:me]), rows[me])
            for g, rows in zip(reduced.wait(), ctx.rows, strict=True)
        ]
        return None, None, None, *mine


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Every member's `tensor` concatenated along the first dimension, in rank order (the
    first dimension may differ per process; the others and the dtype must agree).
    Differentiable."""
    basics.context("allgather")
    if needs_grad([tensor]):
        return _Allgather.apply(name, process_set, "allgather", tensor)[0]
    return start([tensor], "allgather", name, process_set).wait()[0][0]


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start gathering `tensor`; `synchronize(handle)` returns the concatenation."""
    operation = start([tensor], "allgather_async", name, process_set)
    return Handle([operation], lambda: operation.wait()[0][0], "allgather_async", name)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """`allgather` of each of `tensors`, negotiated as one operation. Differentiable."""
    basics.context("grouped_allgather")
    if not tensors:
        return []
    if needs_grad(tensors):
        return list(_Allgather.apply(name, process_set, "grouped_allgather", *tensors))
    what = "grouped_allgather"
    return start(list(tensors), what, name, process_set, what).wait()[0]


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start `grouped_allgather`; `synchronize(handle)` returns the list of results."""
    what = "grouped_allgather_async"
    operation = start(list(tensors), what, name, process_set, "grouped_allgather")
    return Handle([operation], lambda: operation.wait()[0], what, name)


def start_sparse(
    tensor: torch.Tensor, op: ReduceOp, what: str, name: str | None, process_set: ProcessSet
) -> Handle:
    """Queue the all-reduce of a sparse `tensor` as Horovod does it: every member's indices
    and values gathered; the result (coalesced, divided by the members for Average) is the
    sum of the members' tensors."""
    coalesced = tensor.coalesce()
    indices = coalesced.indices().t().contiguous()
    operation = start([indices, coalesced.values()], what, name, process_set)
    size = len(process_sets.members(process_set, what))

    def finish() -> torch.Tensor:
        (all_indices, values), _ = operation.wait()
        if op is ReduceOp.Average:
            values = values / size
        return torch.sparse_coo_tensor(all_indices.t(), values, tensor.shape).coalesce()

    return Handle([operation], finish, what, name)


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
) -> Callable[[], torch.Tensor]:
    """Start the all-reduce of the sparse `tensor` (op: hvd.Average or hvd.Sum) over the
    members of `process_set`; return a function that waits for it and returns the reduced
    sparse tensor (Horovod's handle for this call is such a function)."""
    basics.context("sparse_allreduce_async")
    if not tensor.is_sparse:
        raise HorovodUsageError(
            "hvd.sparse_allreduce_async takes a sparse tensor; pass tensor.to_sparse(), or use "
            "hvd.allreduce_async for a dense one."
        )
    chosen = resolve(op)
    if chosen not in (ReduceOp.Average, ReduceOp.Sum):
        raise HorovodUsageError(
            f"hvd.sparse_allreduce_async reduces with hvd.Average or hvd.Sum, got "
            f"hvd.{chosen.name}; pass one of those."
        )
    return start_sparse(tensor, chosen, "sparse_allreduce_async", name, process_set).wait
