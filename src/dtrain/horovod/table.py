"""The negotiation table: which operations are ready, in which order, and which are
mismatched. Every process holds one and feeds it the same rounds of announcements, so every
process reaches the same decisions without a coordinator (Horovod lets rank 0 decide and
tell the others; here the decision is computed everywhere from the same input).

An operation is ready once every member of its process set has announced it, or has
called `join()`: joined processes take part in all-reduces with zeros, as in Horovod. When
it is ready its announcements are compared; a difference in shape, dtype, reduction op,
root or scale factors becomes an error response, which every member raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.horovod.reduction import ReduceOp
from dtrain.horovod.requests import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BROADCAST,
    JOIN,
    REDUCESCATTER,
    SHUTDOWN,
    Request,
)

Key = tuple[tuple[int, ...], str]


@dataclass
class Response:
    """What every process does next for one operation.

    Attributes:
        kind, name, ranks: the operation, as announced.
        requests: the announcements, by global rank (joined ranks have none).
        joined: members that have joined and take part with zeros.
        error: the message every member raises instead of running it, or None.
        last_joined: for a `join` response, the rank that joined last.
    """

    kind: str
    name: str
    ranks: tuple[int, ...]
    requests: dict[int, Request] = field(default_factory=dict)
    joined: tuple[int, ...] = ()
    error: str | None = None
    last_joined: int = -1

    @property
    def key(self) -> Key:
        """(process set, name), as `Request.key`."""
        return self.ranks, self.name

    @property
    def template(self) -> Request:
        """One announcement (they agree unless `error` says otherwise)."""
        return next(iter(self.requests.values()))


class Table:
    """The operations announced but not yet run, and the joined processes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pending: dict[Key, dict[int, Request]] = {}
        self.joined: dict[int, None] = {}  # in the order they joined
        self.shutdown_by: int | None = None
        self._join_name = JOIN

    def process(self, gathered: list[list[Request]]) -> list[Response]:
        """Add one round's announcements (`gathered[rank]`, in the order each rank issued
        them) and return the responses that became ready, in the order they did."""
        responses: list[Response] = []
        for rank, requests in enumerate(gathered):
            for request in requests:
                if request.kind == JOIN:
                    self.joined[rank] = None
                    self._join_name = request.name
                elif request.kind == SHUTDOWN:
                    if self.shutdown_by is None:
                        self.shutdown_by = rank
                else:
                    self.pending.setdefault(request.key, {})[rank] = request
                    if self._ready(request.key):
                        responses.append(self._respond(request.key))
        if self.joined:
            # Joined processes stand in for the missing announcements of older all-reduces;
            # any other operation is refused at once on the processes that issued it, so
            # they need not agree on its name (automatic names drift between a process that
            # joined early and one whose operations were refused).
            for key in [k for k in self.pending if self._ready(k) or self._refused(k)]:
                responses.append(self._respond(key))
        if len(self.joined) == self.size:
            everyone = tuple(range(self.size))
            last = next(reversed(self.joined))
            responses.append(Response(JOIN, self._join_name, everyone, last_joined=last))
            self.joined.clear()
        return responses

    def waiting_for(self, key: Key) -> tuple[list[int], list[int]]:
        """(ranks that announced operation `key`, member ranks that have not)."""
        announced = sorted(self.pending.get(key, {}))
        ranks, _ = key
        return announced, [r for r in ranks if r not in announced and r not in self.joined]

    def pending_names(self, rank: int) -> list[str]:
        """Names `rank` announced that are still waiting for other processes."""
        return [name for (_, name), by in self.pending.items() if rank in by]

    def _ready(self, key: Key) -> bool:
        ranks, _ = key
        announced = self.pending[key]
        return all(r in announced or r in self.joined for r in ranks)

    def _refused(self, key: Key) -> bool:
        """Whether operation `key` cannot run because a member joined (only all-reduces
        can)."""
        ranks, _ = key
        first = next(iter(self.pending[key].values()))
        return first.kind != ALLREDUCE and any(r in self.joined for r in ranks)

    def _respond(self, key: Key) -> Response:
        requests = self.pending.pop(key)
        ranks, name = key
        first = next(iter(requests.values()))
        joined = tuple(r for r in ranks if r not in requests and r in self.joined)
        response = Response(first.kind, name, ranks, requests, joined)
        response.error = _mismatch(response) or _join_conflict(response)
        return response


def _label(response: Response) -> str:
    return f"hvd.{response.kind} {response.name!r}"


def _join_conflict(response: Response) -> str | None:
    if not response.joined or response.kind == ALLREDUCE:
        return None
    return (
        f"{_label(response)} cannot run while rank(s) {list(response.joined)} have called "
        "hvd.join(): joined processes take part only in all-reduces (with zeros), as in "
        "Horovod. Issue it before those processes join, or on a process set without them."
    )


def _mismatch(response: Response) -> str | None:
    """The message for announcements that disagree, or None."""
    requests = response.requests
    checks = [
        ("kind of operation", lambda q: q.kind),
        ("number of tensors", lambda q: len(q.shapes)),
    ]
    checks.append(("device (CPU or GPU)", lambda q: q.device))
    checks.append(("dtypes", lambda q: q.dtypes))
    kind = response.kind
    if kind in (ALLREDUCE, BROADCAST, REDUCESCATTER):
        checks.append(("shapes", lambda q: q.shapes))
    if kind in (ALLGATHER, ALLTOALL):
        checks.append(("number of dimensions", lambda q: tuple(len(s) for s in q.shapes)))
        checks.append(("dimensions after the first", lambda q: tuple(s[1:] for s in q.shapes)))
    if kind in (ALLREDUCE, REDUCESCATTER):
        checks.append(("reduction ops", lambda q: _op_name(q.op)))
        checks.append(("prescale/postscale factors", lambda q: (q.prescale, q.postscale)))
    if kind == BROADCAST:
        checks.append(("root ranks", lambda q: q.root))
    for what, get in checks:
        values = {rank: get(q) for rank, q in sorted(requests.items())}
        if len(set(values.values())) > 1:
            seen = "; ".join(f"rank {r}: {_show(requests[r], what, v)}" for r, v in values.items())
            return (
                f"{_label(response)}: the processes passed different {what} ({seen}). "
                f"Every process must pass the same {what} to an operation of one name; fix "
                "the call on the processes that differ, or give the operations different names."
            )
    if kind in (ALLGATHER, ALLTOALL) and any(
        len(s) == 0 for q in requests.values() for s in q.shapes
    ):
        return (
            f"{_label(response)} works along the first dimension, so it needs tensors of at "
            "least one dimension, and a process passed a scalar; pass tensor.reshape(1)."
        )
    return None


def _show(request: Request, what: str, value: object) -> str:
    """A rank's value in a mismatch message: dtype and shape together for tensor checks."""
    if what in ("dtypes", "shapes", "number of dimensions", "dimensions after the first"):
        pairs = [f"{d} {tuple(s)}" for d, s in zip(request.dtypes, request.shapes, strict=True)]
        return pairs[0] if len(pairs) == 1 else "[" + ", ".join(pairs) + "]"
    return str(value)


def _op_name(op: int) -> str:
    try:
        return f"hvd.{ReduceOp(op).name}"
    except ValueError:
        return str(op)
