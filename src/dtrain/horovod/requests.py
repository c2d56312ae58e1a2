"""What a process announces when it issues a collective, and the names operations go by.

Horovod matches operations across processes by name, not by the order they are issued.
Every call becomes a `Request` (its name, kind, process set, dtypes, shapes, reduction op,
root, scale factors, alltoall splits); the processes exchange their new requests each
negotiation round, and the operation runs once every process of its set has announced it
(see `table.py`). A call without a name gets one as Horovod makes it: the kind, then
``noname.`` and a counter, so processes that issue their unnamed operations of one kind in
the same order agree on the names.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import NamedTuple

import torch

# The kinds of operation; `allreduce` also covers grouped all-reduces (several tensors).
ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
JOIN = "join"
SHUTDOWN = "shutdown"


class Request(NamedTuple):
    """One process's announcement of one operation (the same on every process that issues
    it, except for allgather's and alltoall's first dimensions and splits).

    Attributes:
        name: the full name, e.g. ``allreduce.fc1.weight`` or ``broadcast.noname.3``.
        kind: one of the kinds above.
        ranks: the global ranks of the operation's process set, sorted.
        dtypes, shapes: per tensor (a grouped operation has several).
        device: "cpu" or "cuda": where the tensors live.
        op: the reduction op (a `ReduceOp` value), -1 where none.
        root: the broadcast root's global rank, -1 where none.
        prescale, postscale: all-reduce and reduce-scatter scale factors.
        splits: rows sent to each member of the set (alltoall).
    """

    name: str
    kind: str
    ranks: tuple[int, ...]
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    device: str = "cpu"
    op: int = -1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[tuple[int, ...], str]:
        """Operations are matched by (process set, name): two sets may use one name."""
        return self.ranks, self.name

    def nbytes(self) -> int:
        """Bytes of all its tensors (what fusion counts against the threshold)."""
        return sum(
            _numel(shape) * dtype_of(d).itemsize
            for d, shape in zip(self.dtypes, self.shapes, strict=True)
        )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def describe(tensors: Sequence[torch.Tensor]) -> dict[str, tuple]:
    """The dtypes, shapes and device type of `tensors`, as a Request holds them."""
    device = tensors[0].device.type if tensors else "cpu"
    return {
        "dtypes": tuple(str(t.dtype) for t in tensors),
        "shapes": tuple(tuple(t.shape) for t in tensors),
        "device": "cuda" if device == "cuda" else "cpu",
    }


def dtype_of(text: str) -> torch.dtype:
    """The torch dtype named by ``str(dtype)`` ("torch.float32")."""
    return getattr(torch, text.rsplit(".", 1)[-1])


def full_name(kind: str, name: str | None, counters: dict, ranks: tuple[int, ...]) -> str:
    """Horovod's operation name: ``KIND.NAME``, or ``KIND.noname.N`` with N counting this
    process's unnamed operations of that kind on that process set (`counters` holds the
    counts; kept per kind and set so that an operation on a subset does not shift the
    names the other processes give their global operations)."""
    if name:
        return f"{kind}.{name}"
    slot = (kind, ranks)
    counters[slot] = counters.get(slot, 0) + 1
    return f"{kind}.noname.{counters[slot]}"


def encode(requests: Sequence[Request]) -> bytes:
    """Requests as bytes for the control channel (plain tuples: small and fast to load)."""
    return pickle.dumps([tuple(r) for r in requests], protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> list[Request]:
    """The requests `encode` wrote."""
    return [Request(*fields) for fields in pickle.loads(payload)]
