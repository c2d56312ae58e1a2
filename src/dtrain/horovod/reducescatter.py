"""Reduce-scatter, Horovod's way: the tensors (the same shape on every process) are
reduced with `Average` (the default) or `Sum`, and process r keeps the r-th slice of the
result along the first dimension. When that dimension does not divide by the number of
processes, the first ``rows % size`` processes get one row more, as in Horovod."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtrain.horovod import basics, process_sets
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle, issue, staged
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, resolve, scale_, torch_op


def slice_rows(rows: int, size: int) -> list[int]:
    """Rows each process keeps: ``rows // size``, one more for the first ``rows % size``."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


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
) -> Handle:
    """Reduce-scatter each of `tensors`; the handle's result is the list of this process's
    slices."""
    ctx = basics.context(what)
    works, pending = [], []
    with torch.no_grad():
        for tensor in tensors:
            if tensor.dim() == 0:
                raise HorovodUsageError(
                    f"hvd.{what} splits along the first dimension, so it needs a tensor of at "
                    "least one dimension, got a scalar; pass tensor.reshape(1)."
                )
            wire = staged(tensor.detach(), what)
            if wire is tensor or wire.data_ptr() == tensor.data_ptr():
                wire = wire.clone()
            scale_(wire, prescale_factor)
            pieces = list(torch.split(wire, slice_rows(wire.shape[0], ctx.size)))
            out = torch.empty_like(pieces[ctx.rank])
            works.append(
                issue(
                    lambda o=out, p=pieces: dist.reduce_scatter(
                        o, [x.contiguous() for x in p], op=torch_op(op), async_op=True
                    ),
                    what,
                    name,
                )
            )
            pending.append((tensor, out))

    def finish() -> list[torch.Tensor]:
        factor = postscale_factor / (ctx.size if op is ReduceOp.Average else 1)
        with torch.no_grad():
            return [scale_(out, factor).to(t.device) for t, out in pending]

    return Handle(works, finish, what, name)


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
    basics.context("reducescatter")
    process_sets.check(process_set)
    chosen = _op(op, "reducescatter")
    compressed, cctx = compression.compress(tensor)
    handle = start([compressed], chosen, prescale_factor, postscale_factor, "reducescatter", name)
    return compression.decompress(handle.wait()[0], cctx)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `reducescatter`; `synchronize(handle)` returns this process's slice."""
    basics.context("reducescatter_async")
    process_sets.check(process_set)
    chosen = _op(op, "reducescatter_async")
    handle = start([tensor], chosen, prescale_factor, postscale_factor, "reducescatter_async", name)
    return Handle([handle], lambda: handle.wait()[0], "reducescatter_async", name)


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
    basics.context("grouped_reducescatter")
    process_sets.check(process_set)
    chosen = _op(op, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    handle = start(
        [c for c, _ in pairs],
        chosen,
        prescale_factor,
        postscale_factor,
        "grouped_reducescatter",
        name,
    )
    return [compression.decompress(r, c) for r, (_, c) in zip(handle.wait(), pairs, strict=True)]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | None = None,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `grouped_reducescatter`; `synchronize(handle)` returns the list of slices."""
    basics.context("grouped_reducescatter_async")
    process_sets.check(process_set)
    chosen = _op(op, "grouped_reducescatter_async")
    return start(
        list(tensors),
        chosen,
        prescale_factor,
        postscale_factor,
        "grouped_reducescatter_async",
        name,
    )
