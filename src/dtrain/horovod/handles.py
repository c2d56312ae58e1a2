"""Issuing an operation (`submit`: name it, describe it, queue it for negotiation) and
the handle an ``*_async`` call returns, with `poll` and `synchronize`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain.horovod import basics, process_sets
from dtrain.horovod.errors import HorovodInternalError, HorovodUsageError
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet
from dtrain.horovod.requests import Request, describe, full_name


def submit(
    kind: str,
    prefix: str,
    name: str | None,
    tensors: Sequence[torch.Tensor],
    process_set: ProcessSet | None,
    what: str,
    **fields: Any,
) -> Operation:
    """Queue an operation of `kind` over `process_set` on `tensors`; its name is
    ``PREFIX.NAME`` or ``PREFIX.noname.N`` (see `requests.full_name`). `fields` fill the
    rest of the Request (op, root, scale factors, splits)."""
    ctx = basics.context(what)
    ranks = process_sets.members(process_set, what)
    request = Request(
        full_name(prefix, name, ctx.counters, ranks), kind, ranks, **describe(tensors), **fields
    )
    return ctx.engine.submit(request, tensors)


class Handle:
    """An operation under way: `hvd.poll(handle)` says whether it finished,
    `hvd.synchronize(handle)` waits for it and returns its result (again, if asked twice)."""

    __slots__ = ("_works", "_finish", "_done", "_result", "_error", "what", "name")

    def __init__(
        self,
        works: Sequence[Operation | Handle],
        finish: Callable[[], Any],
        what: str,
        name: str | None = None,
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self.what = what
        self.name = name

    def poll(self) -> bool:
        """True once the operation finished (waiting would not block)."""
        return self._done or all(w.is_completed() for w in self._works)

    is_completed = poll  # so a handle can wait on another handle, as on an Operation

    def wait(self) -> Any:
        """Block until the operation finished; return its result."""
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                for work in self._works:
                    work.wait()
            except (HorovodInternalError, HorovodUsageError) as e:
                self._error = e
                raise
            self._result = self._finish()
            self._done, self._works, self._finish = True, [], _nothing
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._done else "in flight"
        return f"<hvd handle {self.what} {state}>"


def _nothing() -> None:
    return None


def poll(handle: Handle) -> bool:
    """Whether the asynchronous operation behind `handle` has finished; after True,
    `synchronize(handle)` returns without blocking."""
    _check(handle, "poll")
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for the asynchronous operation behind `handle` and return its result: a tensor,
    a list of tensors (grouped operations), or (output, received_splits) for alltoall."""
    _check(handle, "synchronize")
    return handle.wait()


def _check(handle: object, what: str) -> None:
    if not isinstance(handle, Handle):
        raise HorovodUsageError(
            f"hvd.{what}() takes the handle an hvd.*_async call returned, got "
            f"{type(handle).__name__}; pass that handle."
        )
