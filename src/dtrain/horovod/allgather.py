"""All-gather, Horovod's way: every process's tensor concatenated along the first
dimension, which may differ from process to process (`allgather`, `allgather_async`,
`grouped_allgather`, `grouped_allgather_async`).

The shapes are exchanged first (one small collective, which also reports mismatched
dtypes or trailing dimensions on every process); each tensor is then padded to the
largest first dimension, gathered, and the padding cut away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allreduce import start as start_allreduce
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, issue, staged
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp
from dtrain.horovod.shapes import exchange


def _check_rank(tensors: Sequence[torch.Tensor], what: str) -> None:
    for t in tensors:
        if t.dim() == 0:
            raise HorovodUsageError(
                f"hvd.{what} concatenates along the first dimension, so it needs tensors of "
                "at least one dimension, got a scalar; pass tensor.reshape(1)."
            )


def start(tensors: Sequence[torch.Tensor], what: str, name: str | None) -> tuple[Handle, list]:
    """Gather each of `tensors`; the handle's result is the list of gathered tensors.
    Also returns each tensor's first dimension on every process (rows[i][rank])."""
    ctx = basics.context(what)
    _check_rank(tensors, what)
    entries = exchange(tensors, what, name)
    rows = [[e.shapes[i][0] for e in entries] for i in range(len(tensors))]
    works, pending = [], []
    with torch.no_grad():
        for t, counts in zip(tensors, rows, strict=True):
            wire = staged(t.detach(), what)
            most = max(counts)
            if wire.shape[0] < most:
                padded = wire.new_zeros((most, *wire.shape[1:]))
                padded[: wire.shape[0]] = wire
                wire = padded
            parts = [torch.empty_like(wire) for _ in range(ctx.size)]
            works.append(
                issue(lambda p=parts, w=wire: dist.all_gather(p, w, async_op=True), what, name)
            )
            pending.append((t, parts, counts))

    def finish() -> list[torch.Tensor]:
        return [
            torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]).to(t.device)
            for t, parts, counts in pending
        ]

    return Handle(works, finish, what, name), rows


class _Allgather(torch.autograd.Function):
    """All-gather whose gradient is this process's slice of the averaged incoming
    gradient, as in Horovod."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None):  # type: ignore[override]
        handle, rows = start([tensor], "allgather", name)
        ctx.rows = rows[0]
        return handle.wait()[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        reduced = start_allreduce(
            grad.detach().clone(), ReduceOp.Average, 1.0, 1.0, "allgather", None
        )
        me = basics.rank()
        offset = sum(ctx.rows[:me])
        return reduced.wait().narrow(0, offset, ctx.rows[me]), None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Every process's `tensor` concatenated along the first dimension, in rank order (the
    first dimension may differ per process; the others and the dtype must agree).
    Differentiable."""
    basics.context("allgather")
    process_sets.check(process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Allgather.apply(tensor, name)
    return start([tensor], "allgather", name)[0].wait()[0]


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start gathering `tensor`; `synchronize(handle)` returns the concatenation. The
    shapes are exchanged before this returns (it waits for every process to call it)."""
    basics.context("allgather_async")
    process_sets.check(process_set)
    handle, _ = start([tensor], "allgather_async", name)
    return Handle([handle], lambda: handle.wait()[0], "allgather_async", name)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """`allgather` of each of `tensors`, with one shape exchange for all of them."""
    basics.context("grouped_allgather")
    process_sets.check(process_set)
    if not tensors:
        return []
    return start(list(tensors), "grouped_allgather", name)[0].wait()


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start `grouped_allgather`; `synchronize(handle)` returns the list of results."""
    basics.context("grouped_allgather_async")
    process_sets.check(process_set)
    return start(list(tensors), "grouped_allgather_async", name)[0]
