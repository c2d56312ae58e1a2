"""One small all-gather of every process's tensor shapes and dtypes (and a few integers,
such as alltoall's splits) before a collective whose output size depends on them.

Because every process receives the same table, a mismatch (a different dtype, or another
size in a dimension that must agree) is reported by every process with the same message,
instead of hanging or sending garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.horovod import basics
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import issue, staged

MAX_DIMS = 16
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@dataclass(frozen=True)
class Entry:
    """What one process announced: a dtype and shape per tensor, and its extra integers."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    extra: tuple[int, ...]


def _label(what: str, name: str | None) -> str:
    return f"hvd.{what}" + (f" ({name!r})" if name else "")


def _encode(tensors: Sequence[torch.Tensor], extra: Sequence[int], what: str) -> torch.Tensor:
    row = [len(tensors), len(extra)]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise HorovodUsageError(
                f"hvd.{what} cannot send tensors of dtype {t.dtype}; convert to one of "
                f"{', '.join(str(d) for d in DTYPES)}."
            )
        if t.dim() > MAX_DIMS:
            raise HorovodUsageError(
                f"hvd.{what} takes tensors of at most {MAX_DIMS} dimensions, got {t.dim()}; "
                "reshape the tensor first."
            )
        row += [DTYPES.index(t.dtype), t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]
    return torch.tensor(row + list(extra), dtype=torch.int64)


def _decode(row: list[int]) -> Entry:
    count, n_extra = row[0], row[1]
    dtypes, shapes, at = [], [], 2
    for _ in range(count):
        dtypes.append(DTYPES[row[at]])
        ndim = row[at + 1]
        shapes.append(tuple(row[at + 2 : at + 2 + ndim]))
        at += 2 + MAX_DIMS
    return Entry(tuple(dtypes), tuple(shapes), tuple(row[at : at + n_extra]))


def exchange(
    tensors: Sequence[torch.Tensor], what: str, name: str | None, extra: Sequence[int] = ()
) -> list[Entry]:
    """Every process's Entry, in rank order; raise HorovodUsageError (on every process)
    unless all agree on the number of tensors, their dtypes and every dimension but the
    first. Blocks until every process has called it."""
    size = basics.context(what).size
    mine = staged(_encode(tensors, extra, what), what)
    table = [torch.empty_like(mine) for _ in range(size)]
    issue(lambda: dist.all_gather(table, mine), what, name)
    entries = [_decode(row.tolist()) for row in table]
    first = entries[0]
    for i in range(len(first.shapes)):
        same_dtype = all(e.dtypes[i] == first.dtypes[i] for e in entries)
        same_rest = all(e.shapes[i][1:] == first.shapes[i][1:] for e in entries)
        if not (same_dtype and same_rest):
            seen = "; ".join(
                f"rank {r}: {e.dtypes[i]} {tuple(e.shapes[i])}" for r, e in enumerate(entries)
            )
            which = f" tensor {i} of the group" if len(first.shapes) > 1 else ""
            raise HorovodUsageError(
                f"{_label(what, name)}: the processes' tensors{which} do not match ({seen}). "
                "Every dimension but the first, and the dtype, must be the same on every "
                "process; fix the tensor each process passes."
            )
    return entries
