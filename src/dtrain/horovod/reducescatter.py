"""Reduce-scatter, Horovod's way: the tensors (the same shape on every process) are
reduced with `Average` (the default) or `Sum`, and the r-th member of the process set keeps
the r-th slice of the result along the first dimension. When that dimension does not divide
by the number of processes, the first ``rows % size`` members get one row more, as in
Horovod."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allgather import start as start_allgather
from dtrain.horovod.allreduce import needs_grad
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, submit
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, resolve
from dtrain.horovod.requests import REDUCESCATTER


def _op(op: ReduceOp | None, what: str) -> ReduceOp:
    chosen = resolve(op)
    if chosen not in (ReduceOp.Average, ReduceOp.Sum):
        raise HorovodUsageError(
            f"hvd.{what} reduces with hvd.Average or hvd.Sum only, got hvd.{chosen.name}; pass "
            "one of those."
        )
    return chosen


def start(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    what: str,
    name: str | None,
    process_set: ProcessSet | None = None,
) -> Operation:
    """Queue reduce-scattering each of `tensors`; the operation's result is the list of
    this process's slices."""
    basics.context(what)
    for tensor in tensors:
        if tensor.dim() == 0:
            raise HorovodUsageError(
                f"hvd.{what} splits along the first dimension, so it needs a tensor of at "
                "least one dimension, got a scalar; pass tensor.reshape(1)."
            )
    return submit(
        REDUCESCATTER,
        "reducescatter",
        name,
        [t.detach() for t in tensors],
        process_set,
        what,
        op=int(op),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )


class _Reducescatter(torch.autograd.Function):
    """Reduce-scatter of one or more tensors whose gradients are the all-gather of the
    incoming gradients, scaled as the forward scaled (and by the set's size for `Sum`), as
    in Horovod."""

    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name, ps, what, *tensors):  # type: ignore[override]
        ctx.args = (op, pre, post, ps, what)
        return tuple(start(list(tensors), op, pre, post, what, name, ps).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        op, pre, post, ps, what = ctx.args
        factor = pre * post
        if op is ReduceOp.Sum:
            factor *= len(process_sets.members(ps, what))
        scaled = [g * factor if factor != 1 else g for g in grads]
        prefix = "allgather" if what == "reducescatter" else "grouped_allgather"
        gathered = start_allgather(scaled, what, None, ps, prefix).wait()[0]
        return None, None, None, None, None, None, *gathered


def _apply(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    what: str,
    name: str | None,
    process_set: ProcessSet,
) -> list[torch.Tensor]:
    """This process's slices of `tensors`, reduced; recorded by autograd when one of them
    requires a gradient."""
    if needs_grad(tensors):
        return list(
            _Reducescatter.apply(
                op, prescale_factor, postscale_factor, name, process_set, what, *tensors
            )
        )
    return start(tensors, op, prescale_factor, postscale_factor, what, name, process_set).wait()


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This process's slice of `tensor` reduced over every process (op Average or Sum).
    Differentiable."""
    chosen = _op(op, "reducescatter")
    compressed, cctx = compression.compress(tensor)
    reduced = _apply(
        [compressed], chosen, prescale_factor, postscale_factor, "reducescatter", name, process_set
    )
    return compression.decompress(reduced[0], cctx)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `reducescatter`; `synchronize(handle)` returns this process's slice."""
    what = "reducescatter_async"
    chosen = _op(op, what)
    operation = start([tensor], chosen, prescale_factor, postscale_factor, what, name, process_set)
    return Handle([operation], lambda: operation.wait()[0], what, name)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of each of `tensors`; returns this process's slices.
    Differentiable."""
    chosen = _op(op, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    reduced = _apply(
        [c for c, _ in pairs],
        chosen,
        prescale_factor,
        postscale_factor,
        "grouped_reducescatter",
        name,
        process_set,
    )
    return [compression.decompress(r, c) for r, (_, c) in zip(reduced, pairs, strict=True)]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `grouped_reducescatter`; `synchronize(handle)` returns the list of slices."""
    what = "grouped_reducescatter_async"
    chosen = _op(op, what)
    operation = start(
        list(tensors), chosen, prescale_factor, postscale_factor, what, name, process_set
    )
    return Handle([operation], operation.wait, what, name)
