"""Broadcast from a root process, Horovod's way: `broadcast` (a new tensor;
differentiable), `broadcast_` (in place) and their ``_async`` forms."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allreduce import start as start_allreduce
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, issue, staged
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp


def start(output: torch.Tensor, root_rank: int, what: str, name: str | None) -> Handle:
    """Overwrite `output` with root's; the handle's result is `output`."""
    size = basics.context(what).size
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise HorovodUsageError(
            f"hvd.{what}: root_rank {root_rank!r} is not a rank of this job of {size} "
            f"process(es); pass a rank in [0, {size})."
        )
    with torch.no_grad():
        wire = staged(output.detach(), what)
        work = issue(lambda: dist.broadcast(wire, root_rank, async_op=True), what, name)

    def finish() -> torch.Tensor:
        if wire.data_ptr() != output.data_ptr():
            with torch.no_grad():
                output.copy_(wire)
        return output

    return Handle([work], finish, what, name)


class _Broadcast(torch.autograd.Function):
    """Broadcast whose gradient is the averaged incoming gradient on the root and zero
    elsewhere, as in Horovod."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None):  # type: ignore[override]
        ctx.root_rank = root_rank
        return start(tensor.detach().clone(), root_rank, "broadcast", name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        handle = start_allreduce(
            grad.detach().clone(), ReduceOp.Average, 1.0, 1.0, "broadcast", None
        )
        reduced = handle.wait()
        if basics.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A new tensor holding `root_rank`'s `tensor` (same shape and dtype on every process);
    `tensor` is not modified. Differentiable."""
    basics.context("broadcast")
    process_sets.check(process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Broadcast.apply(tensor, root_rank, name)
    return start(tensor.detach().clone(), root_rank, "broadcast", name).wait()


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s, in place; return it."""
    basics.context("broadcast_")
    process_sets.check(process_set)
    return start(tensor, root_rank, "broadcast_", name).wait()


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start broadcasting into a copy of `tensor`; `synchronize(handle)` returns it."""
    basics.context("broadcast_async")
    process_sets.check(process_set)
    return start(tensor.detach().clone(), root_rank, "broadcast_async", name)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start broadcasting into `tensor` in place; `synchronize(handle)` returns it."""
    basics.context("broadcast_async_")
    process_sets.check(process_set)
    return start(tensor, root_rank, "broadcast_async_", name)
