"""All-to-all, Horovod's way: each process sends `splits[j]` rows (slices along the first
dimension) of its tensor to the j-th member of the process set and receives every member's
rows for it, in rank order. Without `splits` the first dimension is cut into equal parts.
As in Horovod 0.21 and later, `alltoall(tensor, splits)` returns ``(output,
received_splits)``; `alltoall(tensor)` returns the output alone. The splits travel with the
negotiation, so the receive sizes are known when the exchange starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.horovod import process_sets
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, submit
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.requests import ALLTOALL

Splits = torch.Tensor | Sequence[int] | None


def _splits(tensor: torch.Tensor, splits: Splits, size: int, what: str) -> list[int]:
    if tensor.dim() == 0:
        raise HorovodUsageError(
            f"hvd.{what} slices along the first dimension, so it needs a tensor of at least "
            "one dimension, got a scalar; pass tensor.reshape(1)."
        )
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise HorovodUsageError(
                f"hvd.{what}: the first dimension ({rows}) does not divide into {size} equal "
                "parts; pass splits=[rows for each rank] that sum to it."
            )
        return [rows // size] * size
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(s < 0 for s in values) or sum(values) != rows:
        raise HorovodUsageError(
            f"hvd.{what}: splits {values} must hold {size} non-negative counts (one per rank) "
            f"that sum to the first dimension of the tensor ({rows}); fix the splits."
        )
    return values


def start(
    tensor: torch.Tensor,
    splits: Splits,
    what: str,
    name: str | None,
    process_set: ProcessSet | None = None,
) -> tuple[Operation, torch.dtype]:
    """Queue exchanging rows; the operation's result is (output, received splits as a list);
    also returns the dtype the received splits are handed back in (that of `splits`)."""
    members = process_sets.members(process_set, what)
    sent = _splits(tensor, splits, len(members), what)
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    operation = submit(
        ALLTOALL, "alltoall", name, [tensor.detach()], process_set, what, splits=tuple(sent)
    )
    return operation, split_dtype


def _result(operation: Operation, split_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    output, received = operation.wait()
    return output, torch.tensor(received, dtype=split_dtype)


class _Alltoall(torch.autograd.Function):
    """All-to-all whose gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Splits, name: str | None, ps):  # type: ignore[override]
        output, received = _result(*start(tensor, splits, "alltoall", name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: torch.Tensor):  # type: ignore[override]
        returned, _ = _result(*start(grad.contiguous(), ctx.received, "alltoall", None, ctx.ps))
        return returned, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send `splits[j]` rows of `tensor` to each member j and gather what every member
    sends here, in rank order. Returns ``(output, received_splits)`` when `splits` is given,
    else the output alone. Differentiable."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = _result(*start(tensor, splits, "alltoall", name, process_set))
    return output if splits is None else (output, received)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start `alltoall`; `synchronize(handle)` returns ``(output, received_splits)``."""
    operation, split_dtype = start(tensor, splits, "alltoall_async", name, process_set)
    return Handle([operation], lambda: _result(operation, split_dtype), "alltoall_async", name)
