"""Broadcast from a root process, Horovod's way: `broadcast` (a new tensor;
differentiable), `broadcast_` (in place) and their ``_async`` forms. The root is a global
rank, a member of the process set; every process must name the same root."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allreduce import start as start_allreduce
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, submit
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp
from dtrain.horovod.requests import BROADCAST


def start(
    output: torch.Tensor,
    root_rank: int,
    what: str,
    name: str | None,
    process_set: ProcessSet | None = None,
) -> Operation:
    """Queue overwriting `output` with root's; the operation's result is `output`."""
    members = process_sets.members(process_set, what)
    if not isinstance(root_rank, int) or root_rank not in members:
        raise HorovodUsageError(
            f"hvd.{what}: root_rank {root_rank!r} is not a rank of the process set "
            f"{list(members)}; pass the global rank of one of its members."
        )
    return submit(BROADCAST, "broadcast", name, [output], process_set, what, root=root_rank)


class _Broadcast(torch.autograd.Function):
    """Broadcast whose gradient is the averaged incoming gradient on the root and zero
    elsewhere, as in Horovod."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps):  # type: ignore[override]
        ctx.root_rank, ctx.ps = root_rank, ps
        return start(tensor.detach().clone(), root_rank, "broadcast", name, ps).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        operation = start_allreduce(
            [grad.detach().clone()], ReduceOp.Average, 1.0, 1.0, "broadcast", None, ctx.ps
        )
        reduced = operation.wait()[0]
        if basics.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A new tensor holding `root_rank`'s `tensor` (same shape and dtype on every process);
    `tensor` is not modified. Differentiable."""
    basics.context("broadcast")
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return start(tensor.detach().clone(), root_rank, "broadcast", name, process_set).wait()


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s, in place; return it."""
    return start(tensor, root_rank, "broadcast_", name, process_set).wait()


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start broadcasting into a copy of `tensor`; `synchronize(handle)` returns it."""
    operation = start(tensor.detach().clone(), root_rank, "broadcast_async", name, process_set)
    return Handle([operation], operation.wait, "broadcast_async", name)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start broadcasting into `tensor` in place; `synchronize(handle)` returns it."""
    operation = start(tensor, root_rank, "broadcast_async_", name, process_set)
    return Handle([operation], operation.wait, "broadcast_async_", name)
