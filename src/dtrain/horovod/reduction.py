"""Horovod's reduction ops (`Average`, the default, `Sum`, `Min`, `Max`, `Product`;
`Adasum` refused) and the scaling arithmetic around them.

The values are those of Horovod's own enum, so scripts that store or compare them keep
working. `Average` is reduced as a sum divided by the number of processes after the
collective, as Horovod does, so integer tensors average too (truncated toward zero).
"""

from __future__ import annotations

import warnings
from enum import IntEnum

import torch
import torch.distributed as dist

from dtrain.horovod.errors import HorovodUsageError, UnsupportedError


class ReduceOp(IntEnum):
    """How a collective combines the processes' tensors."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

_TORCH_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM,
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


def resolve(op: object, average: bool | None = None) -> ReduceOp:
    """The op a call asks for: `op`, or the deprecated `average` flag, or Average.

    Raises HorovodUsageError for an unknown op or both arguments, UnsupportedError for
    Adasum.
    """
    if op is not None and average is not None:
        raise HorovodUsageError(
            "Both op and the deprecated average argument were given; pass op only "
            "(op=hvd.Average or op=hvd.Sum)."
        )
    if average is not None:
        warnings.warn(
            "The average argument is deprecated in Horovod; pass op=hvd.Average or op=hvd.Sum.",
            DeprecationWarning,
            stacklevel=3,
        )
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    try:
        chosen = ReduceOp(op)  # type: ignore[call-overload]
    except (ValueError, TypeError):
        known = ", ".join(f"hvd.{o.name}" for o in ReduceOp if o is not ReduceOp.Adasum)
        raise HorovodUsageError(f"Unknown reduction op {op!r}; use one of {known}.") from None
    if chosen is ReduceOp.Adasum:
        raise UnsupportedError(
            "hvd.Adasum is not supported by dtrain; use op=hvd.Average (the default) or "
            "op=hvd.Sum, and scale the learning rate by hvd.size() as for plain averaging."
        )
    return chosen


def torch_op(op: ReduceOp) -> dist.ReduceOp:
    """The torch.distributed op that carries `op` over the wire (Average travels as Sum)."""
    return _TORCH_OPS[op]


def check_scalable(
    tensors: list[torch.Tensor], op: ReduceOp, prescale: float, postscale: float, size: int
) -> None:
    """Refuse, before anything is sent, a boolean tensor that would have to be scaled."""
    scaled = prescale != 1 or postscale != 1 or (op is ReduceOp.Average and size > 1)
    if scaled and any(t.dtype == torch.bool for t in tensors):
        raise HorovodUsageError(
            "A boolean tensor cannot be averaged or scaled; use op=hvd.Sum, hvd.Min or "
            "hvd.Max, or convert it to an integer or float tensor first."
        )


def scale_(tensor: torch.Tensor, factor: float, divisor: int = 1) -> torch.Tensor:
    """Multiply `tensor` by `factor`, then divide it by `divisor` (an average's count), in
    place, as Horovod does: a true division, so that an average of equal values is exact
    (a multiplication by 1/3 is not); integer tensors are scaled in float64 and truncated
    toward zero."""
    if factor == 1 and divisor == 1:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        if factor != 1:
            tensor.mul_(factor)
        return tensor.div_(divisor) if divisor != 1 else tensor
    if tensor.dtype == torch.bool:
        raise HorovodUsageError(
            "A boolean tensor cannot be averaged or scaled; use op=hvd.Sum, hvd.Min or "
            "hvd.Max, or convert it to an integer or float tensor first."
        )
    return tensor.copy_(torch.trunc(tensor.double() * factor / divisor))
