"""The negotiation engine: each process runs one background thread that announces the
operations its calls issue, agrees with the others on which are ready (`table.py`) and
starts them, in the agreed order, on the data process groups (`execute.py`).

A call returns (or its ``_async`` form hands back a handle) as soon as its request is
queued; the thread starts the collective once every process of the set has announced it,
so processes may issue operations in any order, and an operation's result is awaited on
its `Operation`. The collectives themselves run asynchronously, so all-reduces that
backward starts overlap the rest of backward. A one-process job runs each round in the
calling thread, with no thread and no control channel.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod.channel import Channel
from dtrain.horovod.errors import HorovodInternalError, HorovodUsageError, MismatchError
from dtrain.horovod.requests import JOIN, SHUTDOWN, Request, decode, encode
from dtrain.horovod.table import Key, Response, Table
from dtrain.horovod.timeline import Timeline


class Operation:
    """One operation this process issued: its request, its local tensors, and, once the
    engine started it, the collectives to wait for and how to turn them into its result."""

    __slots__ = (
        "request",
        "tensors",
        "issued",
        "_seen_done",
        "started",
        "works",
        "_finish",
        "error",
        "_result",
        "_engine",
    )

    def __init__(
        self, request: Request, tensors: Sequence[torch.Tensor], engine: Negotiation
    ) -> None:
        self.request = request
        self.tensors = list(tensors)
        self.issued = time.time()
        self._seen_done: Callable[[], None] | None = None
        self.started = threading.Event()
        self.works: list[dist.Work] = []
        self._finish: Callable[[], Any] | None = None
        self.error: BaseException | None = None
        self._result: Any = None
        self._engine = engine

    def start(self, works: Sequence[dist.Work | None], finish: Callable[[], Any]) -> None:
        """Called by the engine once the collectives are under way."""
        self.works = [w for w in works if w is not None]
        self._finish = finish
        timeline = self._engine.timeline
        if timeline is not None and self.request.kind != SHUTDOWN:
            request = self.request
            self._seen_done = timeline.started(request.name, request.kind, self.issued, self.works)
        self.started.set()

    def fail(self, error: BaseException) -> None:
        """Called by the engine when the operation will not run."""
        self.error = error
        self.started.set()

    def is_completed(self) -> bool:
        """True once waiting would not block."""
        return self.started.is_set() and (
            self.error is not None or all(w.is_completed() for w in self.works)
        )

    def wait(self) -> Any:
        """Block until the operation finished; return its result (or raise its error)."""
        if not self.started.is_set():
            self._engine.await_start(self)
        if self.error is not None:
            raise self.error
        if self._finish is not None:
            try:
                for work in self.works:
                    work.wait()
            except RuntimeError as e:  # DistError and gloo's errors are RuntimeErrors
                self.error = HorovodInternalError(
                    f"hvd.{self.request.kind} {self.request.name!r} failed: {e}. A peer process "
                    "may have died; check the other ranks' output."
                )
                raise self.error from e
            if self._seen_done is not None:
                self._seen_done()
            self._result = self._finish()
            self._finish, self.works = None, []
        return self._result


Runner = Callable[[list[tuple[Response, "Operation | None"]]], None]


class Negotiation:
    """Announces, negotiates and starts this process's operations.

    Args:
        rank, size: this process's rank and the job's size.
        channel: the control channel; None for a one-process job.
        run: starts a batch of ready responses (each with this process's Operation, or
            None where this process joined or is not a member); see `execute.py`.
        plan: cuts a round's responses into batches (fusion).
        timeout_s: how long an operation may wait for the others before it fails.
        warn_s: how long it may wait before a warning names the missing processes (None:
            never), as Horovod's stall check does.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        channel: Channel | None,
        run: Runner,
        plan: Callable[[list[Response]], list[list[Response]]],
        timeout_s: float,
        warn_s: float | None = 60.0,
    ) -> None:
        self.rank, self.size = rank, size
        self._warn_s = warn_s
        self._channel = channel
        self._run, self._plan = run, plan
        self._timeout_s = timeout_s
        self._table = Table(size)
        self._lock = threading.Lock()
        self._inline = threading.Lock()
        self._queue: list[Operation] = []
        self._local: dict[Key, Operation] = {}
        self._round = 0
        self._rung = -1
        self._closed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.timeline: Timeline | None = None
        """Horovod's timeline while one records (`timeline.py`)."""
        if channel is not None:
            self._thread = threading.Thread(target=self._loop, name="hvd-negotiation", daemon=True)
            self._thread.start()

    # --- the calling threads ------------------------------------------------------------

    def submit(self, request: Request, tensors: Sequence[torch.Tensor] = ()) -> Operation:
        """Queue `request` (with this process's `tensors`) for the next round."""
        operation = Operation(request, tensors, self)
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if request.key in self._local and request.kind != SHUTDOWN:
                raise HorovodUsageError(
                    f"hvd.{request.kind}: an operation named {request.name!r} is already in "
                    "flight on this process; wait for it (hvd.synchronize) before issuing "
                    "another of that name, or give the new one a different name."
                )
            self._local[request.key] = operation
            self._queue.append(operation)
            round_, ring = self._round, self._rung != self._round
            self._rung = self._round
        if self._channel is None:
            self._round_here()
        elif ring:
            try:
                self._channel.ring(round_)
            except RuntimeError as e:
                self._shut(HorovodInternalError(f"The negotiation store is unreachable ({e})."))
                raise self._closed from e  # type: ignore[misc]
        return operation

    def await_start(self, operation: Operation) -> None:
        """Wait until `operation` started, warning after `warn_s` and failing after the
        timeout with the ranks that have not issued it (`join` waits without limit: the
        others may train long after it, and the launcher reports a process that dies)."""
        if operation.request.kind == JOIN:
            # A joined process waits as long as the others have data: not a stall.
            operation.started.wait()
            return
        start = time.monotonic()
        warned = False
        while not operation.started.wait(1.0):
            waited = time.monotonic() - start
            if waited >= self._timeout_s:
                self._expire(operation, waited)
            if self._warn_s is not None and waited >= self._warn_s and not warned:
                warned = True
                warnings.warn(self._stall(operation, waited), stacklevel=4)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Tell every process this one shuts down, and stop the thread; False if the
        thread is still inside a round (a peer gone mid-round) after `timeout_s`."""
        if self._closed is None:
            with contextlib.suppress(HorovodInternalError, HorovodUsageError):
                self.submit(Request(SHUTDOWN, SHUTDOWN, (self.rank,)))
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._shut(HorovodInternalError("Horovod has been shut down on this process."))
        return self._thread is None or not self._thread.is_alive()

    # --- the negotiation thread -----------------------------------------------------------

    def _loop(self) -> None:
        assert self._channel is not None
        round_ = 0
        try:
            while self._table.shutdown_by is None:
                self._channel.wait(round_)
                self._mark_cycle()
                batch = self._drain(round_)
                gathered = [
                    decode(p)
                    for p in self._channel.gather(round_, encode([op.request for op in batch]))
                ]
                self._channel.forget(round_)
                self._decide(gathered)
                round_ += 1
        except Exception as e:  # noqa: BLE001 - every waiting operation must hear of it
            self._shut(
                HorovodInternalError(
                    f"Horovod's negotiation between the processes failed ({e}); a peer process "
                    "may have died or shut down. Check the other ranks' output."
                )
            )
            return
        self._shut(
            HorovodInternalError(
                f"Horovod has been shut down by rank {self._table.shutdown_by} (hvd.shutdown(), "
                "or the end of its script), so this operation cannot run on every process; "
                "make every process issue the same operations before any of them shuts down."
            )
        )

    def _round_here(self) -> None:
        """A one-process round, in the calling thread (one round at a time)."""
        with self._inline:
            self._mark_cycle()
            batch = self._drain(self._round)
            self._decide([[op.request for op in batch]])

    def _mark_cycle(self) -> None:
        timeline = self.timeline
        if timeline is not None:
            timeline.cycle()

    def _drain(self, round_: int) -> list[Operation]:
        with self._lock:
            batch, self._queue = self._queue, []
            self._round = round_ + 1
        return batch

    def _decide(self, gathered: list[list[Request]]) -> None:
        with self._lock:
            responses = self._table.process(gathered)
            pairs = {r.key: self._local.pop(r.key, None) for r in responses}
        for batch in self._plan(responses):
            ready = []
            for response in batch:
                operation = pairs[response.key]
                if response.error is not None:
                    if operation is not None:
                        operation.fail(MismatchError(response.error))
                elif operation is not None or self.rank in response.joined:
                    ready.append((response, operation))
            if ready:
                self._start(ready)

    def _start(self, ready: list[tuple[Response, Operation | None]]) -> None:
        try:
            self._run(ready)
        except Exception as e:  # noqa: BLE001 - the caller waiting on it must hear of it
            for response, operation in ready:
                if operation is not None and not operation.started.is_set():
                    operation.fail(
                        HorovodInternalError(f"hvd.{response.kind} {response.name!r} failed: {e}")
                    )

    def _shut(self, error: BaseException) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = error
            waiting = list(self._local.values())
            self._local.clear()
            self._queue.clear()
        for operation in waiting:
            if not operation.started.is_set():
                operation.fail(self._closed)

    # --- messages ---------------------------------------------------------------------------

    def _stall(self, operation: Operation, waited: float) -> str:
        request = operation.request
        with self._lock:
            announced, missing = self._table.waiting_for(request.key)
            elsewhere = {r: self._table.pending_names(r)[:3] for r in missing}
        if self.rank in missing:
            # Not even this process's announcement went through: the round that carries
            # it never completed, so some process stopped negotiating altogether.
            return (
                f"hvd.{request.kind} {request.name!r} has waited {waited:.0f} s for the "
                "processes to exchange their announcements, and the exchange has not "
                "completed: a process stopped taking part (it died, hangs outside Horovod, "
                "or its machine is unreachable). Check the other ranks' output."
            )
        hints = "; ".join(
            f"rank {r} is waiting on {names}" for r, names in elsewhere.items() if names
        )
        return (
            f"hvd.{request.kind} {request.name!r} has waited {waited:.0f} s for rank(s) {missing} "
            f"to issue it (rank(s) {announced or [self.rank]} have). "
            + (f"Meanwhile {hints}. " if hints else "")
            + "Every process of the set must issue an operation of the same name; check the "
            "names, and that no process skipped the call or left the loop early (hvd.join() "
            "lets a process that ran out of data stop)."
        )

    def _expire(self, operation: Operation, waited: float) -> None:
        message = self._stall(operation, waited) + (
            f" It failed after {self._timeout_s:g} s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, else "
            "HOROVOD_GLOO_TIMEOUT_SECONDS or dtrain's --timeout)."
        )
        with self._lock:
            if self._local.get(operation.request.key) is operation:
                del self._local[operation.request.key]
        operation.fail(HorovodInternalError(message))
        raise operation.error  # type: ignore[misc]
