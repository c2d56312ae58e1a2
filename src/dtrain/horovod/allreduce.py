"""All-reduce, Horovod's way: `allreduce` (a new tensor; differentiable), `allreduce_`
(in place), their ``_async`` forms returning a handle, and the grouped forms, which fuse
tensors of one dtype and device into one flat buffer and one collective.

The result is ``postscale * reduce(prescale * x)``, divided by the number of processes
for `Average`. Operations are matched across processes by the order they are issued
(``name`` is kept for messages only), so every process must issue the same all-reduces
in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics, process_sets
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.handles import Handle, issue, staged
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, resolve, scale_, torch_op


def start(
    output: torch.Tensor,
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    what: str,
    name: str | None,
) -> Handle:
    """Reduce `output` in place across processes; the handle's result is `output`."""
    size = basics.context(what).size
    with torch.no_grad():
        scale_(output, prescale_factor)
        wire = staged(output, what)
        work = issue(lambda: dist.all_reduce(wire, op=torch_op(op), async_op=True), what, name)

    def finish() -> torch.Tensor:
        with torch.no_grad():
            if wire is not output:
                output.copy_(wire)
            scale_(output, postscale_factor / (size if op is ReduceOp.Average else 1))
        return output

    return Handle([work], finish, what, name)


def start_grouped(
    outputs: Sequence[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    what: str,
    name: str | None,
) -> Handle:
    """Reduce every tensor of `outputs` in place, one collective per dtype and device;
    the handle's result is the list `outputs`."""
    size = basics.context(what).size
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in outputs:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    flats: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    works = []
    with torch.no_grad():
        for members in buckets.values():
            flat = staged(torch.cat([t.reshape(-1) for t in members]), what)
            scale_(flat, prescale_factor)
            works.append(
                issue(lambda f=flat: dist.all_reduce(f, op=torch_op(op), async_op=True), what, name)
            )
            flats.append((members, flat))

    def finish() -> list[torch.Tensor]:
        factor = postscale_factor / (size if op is ReduceOp.Average else 1)
        with torch.no_grad():
            for members, flat in flats:
                scale_(flat, factor)
                offset = 0
                for t in members:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view(t.shape))
                    offset += n
        return list(outputs)

    return Handle(works, finish, what, name)


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy to reduce into, so the caller's tensor is left as it was."""
    return tensor.detach().clone()


class _Allreduce(torch.autograd.Function):
    """All-reduce whose gradient is the all-reduce of the incoming gradient with the same
    op and scaling, as in Horovod."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name):  # type: ignore[override]
        ctx.args = (op, pre, post)
        return start(_fresh(tensor), op, pre, post, "allreduce", name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        op, pre, post = ctx.args
        return start(_fresh(grad), op, pre, post, "allreduce", None).wait(), None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    """Grouped all-reduce, differentiable like `_Allreduce`."""

    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.args = (op, pre, post)
        fresh = [_fresh(t) for t in tensors]
        return tuple(start_grouped(fresh, op, pre, post, "grouped_allreduce", name).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        op, pre, post = ctx.args
        fresh = [_fresh(g) for g in grads]
        reduced = start_grouped(fresh, op, pre, post, "grouped_allreduce", None).wait()
        return (None, None, None, None, *reduced)


def _needs_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A new tensor: `tensor` reduced over every process with `op` (default Average);
    `tensor` is not modified. Differentiable. `compression` shrinks what is sent."""
    basics.context("allreduce")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    compressed, cctx = compression.compress(tensor)
    if _needs_grad([compressed]):
        reduced = _Allreduce.apply(compressed, chosen, prescale_factor, postscale_factor, name)
    else:
        out = _fresh(compressed) if compressed is tensor else compressed.detach()
        reduced = start(out, chosen, prescale_factor, postscale_factor, "allreduce", name).wait()
    return compression.decompress(reduced, cctx)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing a copy of `tensor`; `synchronize(handle)` returns the new tensor."""
    basics.context("allreduce_async")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    return start(_fresh(tensor), chosen, prescale_factor, postscale_factor, "allreduce_async", name)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing `tensor` in place; `synchronize(handle)` returns `tensor`, reduced."""
    basics.context("allreduce_async_")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    return start(tensor, chosen, prescale_factor, postscale_factor, "allreduce_async_", name)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` in place over every process and return it."""
    basics.context("allreduce_")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    return start(tensor, chosen, prescale_factor, postscale_factor, "allreduce_", name).wait()


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """New tensors: each of `tensors` reduced over every process, in one fused collective
    per dtype and device. Differentiable."""
    basics.context("grouped_allreduce")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if _needs_grad(compressed):
        reduced = list(
            _GroupedAllreduce.apply(chosen, prescale_factor, postscale_factor, name, *compressed)
        )
    else:
        outs = [
            _fresh(c) if c is t else c.detach() for c, t in zip(compressed, tensors, strict=True)
        ]
        handle = start_grouped(
            outs, chosen, prescale_factor, postscale_factor, "grouped_allreduce", name
        )
        reduced = handle.wait()
    return [compression.decompress(r, c) for r, (_, c) in zip(reduced, pairs, strict=True)]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing copies of `tensors`; `synchronize(handle)` returns the new list."""
    basics.context("grouped_allreduce_async")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    outs = [_fresh(t) for t in tensors]
    return start_grouped(
        outs, chosen, prescale_factor, postscale_factor, "grouped_allreduce_async", name
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing `tensors` in place; `synchronize(handle)` returns them, reduced."""
    basics.context("grouped_allreduce_async_")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    return start_grouped(
        list(tensors), chosen, prescale_factor, postscale_factor, "grouped_allreduce_async_", name
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce every tensor of `tensors` in place over every process; return them."""
    basics.context("grouped_allreduce_")
    process_sets.check(process_set)
    chosen = resolve(op, average)
    handle = start_grouped(
        list(tensors), chosen, prescale_factor, postscale_factor, "grouped_allreduce_", name
    )
    return handle.wait()
