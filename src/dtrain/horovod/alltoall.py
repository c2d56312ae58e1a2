"""All-to-all, Horovod's way: each process sends `splits[j]` rows (slices along the first
dimension) of its tensor to process j and receives every process's rows for it, in rank
order. Without `splits` the first dimension is cut into equal parts. As in Horovod 0.21
and later, `alltoall(tensor, splits)` returns ``(output, received_splits)``;
`alltoall(tensor)` returns the output alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics, process_sets
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, issue, staged
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.shapes import exchange

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


def start(tensor: torch.Tensor, splits: Splits, what: str, name: str | None) -> Handle:
    """Exchange rows; the handle's result is (output, received_splits)."""
    ctx = basics.context(what)
    sent = _splits(tensor, splits, ctx.size, what)
    entries = exchange([tensor], what, name, extra=sent)
    received = [e.extra[ctx.rank] for e in entries]
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    with torch.no_grad():
        wire = staged(tensor.detach(), what)
        out = wire.new_empty((sum(received), *wire.shape[1:]))
        work = issue(
            lambda: dist.all_to_all_single(
                out, wire, output_split_sizes=received, input_split_sizes=sent, async_op=True
            ),
            what,
            name,
        )

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        return out.to(tensor.device), torch.tensor(received, dtype=split_dtype)

    return Handle([work], finish, what, name)


class _Alltoall(torch.autograd.Function):
    """All-to-all whose gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Splits, name: str | None):  # type: ignore[override]
        output, received = start(tensor, splits, "alltoall", name).wait()
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: torch.Tensor):  # type: ignore[override]
        returned, _ = start(grad.contiguous(), ctx.received, "alltoall", None).wait()
        return returned, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send `splits[j]` rows of `tensor` to each process j and gather what every process
    sends here, in rank order. Returns ``(output, received_splits)`` when `splits` is given,
    else the output alone. Differentiable."""
    basics.context("alltoall")
    process_sets.check(process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        output, received = _Alltoall.apply(tensor, splits, name)
    else:
        output, received = start(tensor, splits, "alltoall", name).wait()
    return output if splits is None else (output, received)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start `alltoall`; `synchronize(handle)` returns ``(output, received_splits)``. The
    splits are exchanged before this returns (it waits for every process to call it)."""
    basics.context("alltoall_async")
    process_sets.check(process_set)
    return start(tensor, splits, "alltoall_async", name)
