"""Reduce-scatter, Horovod's way: the tensors (the same shape on every process) are
reduced with `Average` (the default) or `Sum`, and the r-th member of the process set keeps
the r-th slice of the result along the first dimension. When that dimension does not divide
by the number of processes, the first ``rows % size`` members get one row more, as in
Horovod."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.horovod import basics
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.engine import Operation
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, submit
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


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This process's slice of `tensor` reduced over every process (op Average or Sum)."""
    chosen = _op(op, "reducescatter")
    compressed, cctx = compression.compress(tensor)
    operation = start(
        [compressed], chosen, prescale_factor, postscale_factor, "reducescatter", name, process_set
    )
    return compression.decompress(operation.wait()[0], cctx)


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
    """`reducescatter` of each of `tensors`; returns this process's slices."""
    chosen = _op(op, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    operation = start(
        [c for c, _ in pairs],
        chosen,
        prescale_factor,
        postscale_factor,
        "grouped_reducescatter",
        name,
        process_set,
    )
    reduced = operation.wait()
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
