"""All-reduce, Horovod's way: `allreduce` (a new tensor; differentiable), `allreduce_`
(in place), their ``_async`` forms returning a handle, and the grouped forms, whose tensors
are negotiated as one operation and reduced together (one collective per dtype).

The result is ``postscale * reduce(prescale * x)``, divided by the size of the process
set for `Average`. Operations are matched across processes by name (``allreduce.NAME``,
or an automatic ``allreduce.noname.N``), so processes may issue them in any order; all
processes must agree on the shape, dtype, op and scale factors of each name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.horovod import basics
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.handles import Handle, submit
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, check_scalable, resolve
from dtrain.horovod.requests import ALLREDUCE


def start(
    outputs: Sequence[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    what: str,
    name: str | None,
    process_set: ProcessSet | None = None,
    prefix: str = "allreduce",
) -> Operation:
    """Queue reducing every tensor of `outputs` in place; the operation's result is the
    list `outputs`, reduced."""
    tensors = list(outputs)  # reduced in place (under no_grad), and returned as they are
    check_scalable(tensors, op, prescale_factor, postscale_factor, basics.context(what).size)
    return submit(
        ALLREDUCE,
        prefix,
        name,
        tensors,
        process_set,
        what,
        op=int(op),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )


def _first(operation: Operation) -> Any:
    return operation.wait()[0]


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy to reduce into, so the caller's tensor is left as it was."""
    return tensor.detach().clone()


class _Allreduce(torch.autograd.Function):
    """All-reduce whose gradient is the all-reduce of the incoming gradient with the same
    op, scaling and process set, as in Horovod."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name, ps):  # type: ignore[override]
        ctx.args = (op, pre, post, ps)
        return _first(start([_fresh(tensor)], op, pre, post, "allreduce", name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        op, pre, post, ps = ctx.args
        reduced = _first(start([_fresh(grad)], op, pre, post, "allreduce", None, ps))
        return reduced, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    """Grouped all-reduce, differentiable like `_Allreduce`."""

    @staticmethod
    def forward(ctx: Any, op: ReduceOp, pre: float, post: float, name, ps, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.args = (op, pre, post, ps)
        fresh = [_fresh(t) for t in tensors]
        operation = start(fresh, op, pre, post, "grouped_allreduce", name, ps, "grouped_allreduce")
        return tuple(operation.wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        op, pre, post, ps = ctx.args
        fresh = [_fresh(g) for g in grads]
        operation = start(fresh, op, pre, post, "grouped_allreduce", None, ps, "grouped_allreduce")
        return (None, None, None, None, None, *operation.wait())


def needs_grad(tensors: Sequence[torch.Tensor]) -> bool:
    """True if autograd records an operation on `tensors` (one of them requires a
    gradient, outside no_grad)."""
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
    """A new tensor: `tensor` reduced over the processes of `process_set` with `op`
    (default Average); `tensor` is not modified. Differentiable. `compression` shrinks
    what is sent."""
    basics.context("allreduce")
    chosen = resolve(op, average)
    compressed, cctx = compression.compress(tensor)
    if needs_grad([compressed]):
        reduced = _Allreduce.apply(
            compressed, chosen, prescale_factor, postscale_factor, name, process_set
        )
    else:
        out = _fresh(compressed) if compressed is tensor else compressed.detach()
        operation = start(
            [out], chosen, prescale_factor, postscale_factor, "allreduce", name, process_set
        )
        reduced = _first(operation)
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
    chosen = resolve(op, average)
    operation = start(
        [_fresh(tensor)], chosen, prescale_factor, postscale_factor, "allreduce_async", name,
        process_set,
    )  # fmt: skip
    return Handle([operation], lambda: _first(operation), "allreduce_async", name)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing `tensor` in place; `synchronize(handle)` returns `tensor`, reduced.
    Leave `tensor` alone until then."""
    basics.context("allreduce_async_")
    chosen = resolve(op, average)
    operation = start(
        [tensor], chosen, prescale_factor, postscale_factor, "allreduce_async_", name, process_set
    )
    return Handle([operation], lambda: tensor, "allreduce_async_", name)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` in place over the processes of `process_set` and return it."""
    handle = allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return handle.wait()


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
    """New tensors: each of `tensors` reduced over the processes of `process_set`, as one
    negotiated operation. Differentiable."""
    basics.context("grouped_allreduce")
    chosen = resolve(op, average)
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if needs_grad(compressed):
        reduced = list(
            _GroupedAllreduce.apply(
                chosen, prescale_factor, postscale_factor, name, process_set, *compressed
            )
        )
    else:
        outs = [
            _fresh(c) if c is t else c.detach() for c, t in zip(compressed, tensors, strict=True)
        ]
        reduced = start(
            outs, chosen, prescale_factor, postscale_factor, "grouped_allreduce", name,
            process_set, "grouped_allreduce",
        ).wait()  # fmt: skip
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
    return grouped_allreduce_async_(
        [_fresh(t) for t in tensors], average, name, op, prescale_factor, postscale_factor,
        process_set, "grouped_allreduce_async",
    )  # fmt: skip


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    what: str = "grouped_allreduce_async_",
) -> Handle:
    """Start reducing `tensors` in place; `synchronize(handle)` returns them, reduced."""
    basics.context(what)
    chosen = resolve(op, average)
    operation = start(
        list(tensors), chosen, prescale_factor, postscale_factor, what, name, process_set,
        "grouped_allreduce",
    )  # fmt: skip
    return Handle([operation], operation.wait, what, name)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce every tensor of `tensors` in place over the processes of `process_set`;
    return them."""
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set,
        "grouped_allreduce_",
    )  # fmt: skip
    return handle.wait()
