"""Asynchronous operations: the handle an ``*_async`` call returns, `poll` and
`synchronize`, and the wrapping of a failed collective into HorovodInternalError."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics
from dtrain.horovod.errors import HorovodInternalError, HorovodUsageError


def failure(what: str, name: str | None, error: BaseException) -> HorovodInternalError:
    """The error a failed collective becomes: what failed, and what to look at."""
    label = f"hvd.{what}" + (f" ({name!r})" if name else "")
    return HorovodInternalError(
        f"{label} failed: {error}. A peer process may have died, or the processes issued "
        "different collectives in a different order (dtrain matches operations by the "
        "order they are issued, not by name); check the other ranks' output."
    )


def issue(start: Callable[[], dist.Work | None], what: str, name: str | None) -> dist.Work | None:
    """Start a torch.distributed collective, turning its errors into HorovodInternalError."""
    try:
        return start()
    except RuntimeError as e:  # DistError and gloo's errors are RuntimeErrors
        raise failure(what, name, e) from e


class Handle:
    """An operation under way: `hvd.poll(handle)` says whether it finished,
    `hvd.synchronize(handle)` waits for it and returns its result (again, if asked twice)."""

    __slots__ = ("_works", "_finish", "_done", "_result", "_error", "what", "name")

    def __init__(
        self,
        works: Sequence[dist.Work | Handle | None],
        finish: Callable[[], Any],
        what: str,
        name: str | None = None,
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._error: HorovodInternalError | None = None
        self.what = what
        self.name = name

    def poll(self) -> bool:
        """True once the collective finished (waiting would not block)."""
        return self._done or all(w.is_completed() for w in self._works)

    is_completed = poll  # so a handle can wait on another handle, as on a dist.Work

    def wait(self) -> Any:
        """Block until the collective finished; return its result."""
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                for work in self._works:
                    work.wait()
            except RuntimeError as e:  # DistError and gloo's errors are RuntimeErrors
                self._error = failure(self.what, self.name, e)
                raise self._error from e
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


def staged(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """`tensor` itself if the process group can send it as it is, else a contiguous copy on
    a device the group handles (a CPU tensor under an NCCL-only group goes to the GPU)."""
    devices = basics.context(what).devices
    if tensor.device.type in devices:
        return tensor if tensor.is_contiguous() else tensor.contiguous()
    if "cpu" in devices:
        return tensor.to("cpu", copy=True).contiguous()
    return tensor.to(torch.device("cuda", torch.cuda.current_device()), copy=True).contiguous()
