"""Horovod's timeline (``HOROVOD_TIMELINE=FILE``, ``horovodrun --timeline-filename FILE``,
`hvd.start_timeline`): when each operation was issued, negotiated and done, on every
process, as one Chrome/Perfetto trace like dtrain's ``--trace``.

Each process records two spans per operation on a row of its own named after the
operation, as Horovod draws them: ``NEGOTIATE_<KIND>``, from the call until every process
of its set had issued it (an early process waits long, the last one hardly at all), and
``<KIND>``, from the start of its collectives until the last of them completed (their
futures mark it, so recording makes nobody wait). With mark_cycles, each negotiation
round is an instant mark on a row of its own. When the timeline stops (`hvd.stop_timeline`,
`hvd.shutdown`, or the end of the script) every process hands its spans to rank 0
through the job's store, and rank 0 writes the file: a process per rank, on the wall
clock (the same clock for the processes of one machine; across machines as close as the
machines' clocks are).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.horovod import basics
from dtrain.observe.trace import process_names, write_events

TIMELINE_VAR = "HOROVOD_TIMELINE"
MARK_CYCLES_VAR = "HOROVOD_TIMELINE_MARK_CYCLES"
GATHER_WAIT_S = 30.0
"""How long rank 0 waits, in all, for the other processes' spans when the timeline stops."""
MAX_SPANS = 200_000
"""Spans one process keeps (about 16 MB handed to rank 0); later ones are counted, not
kept, so that a long run's timeline stays a file a browser opens."""

Span = tuple[str, str, float, float]
"""(row: the operation's name, span name, start, end), times in wall-clock seconds."""

_CYCLES = "negotiation cycles"


class Timeline:
    """One process's record of its operations while the timeline runs.

    Args:
        path: the file rank 0 writes.
        rank: this process's rank.
        mark_cycles: also mark the start of every negotiation round.
    """

    def __init__(self, path: str | Path, rank: int, mark_cycles: bool = False) -> None:
        self.path = Path(path)
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.dropped = 0
        """Spans not kept once `MAX_SPANS` were."""

    def started(
        self, name: str, kind: str, issued: float, works: list[dist.Work]
    ) -> Callable[[], None]:
        """Operation `name` of `kind`, issued at wall-clock time `issued`, has started its
        collectives `works`: record its negotiation now, and its run when the last of them
        completes. Returns what to call once the caller saw them complete, for the
        collectives whose backend gives no future to be told by (gloo's reduce-scatter)."""
        now = time.time()
        label = kind.upper()
        self._add((name, f"NEGOTIATE_{label}", issued, now))
        left = [len(works)]

        def done() -> None:
            with self._lock:
                if left[0] >= 0:
                    left[0] = -1
                    self._keep((name, label, now, time.time()))

        def one_done(_: Any) -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done()

        if not works:
            done()
        try:
            for work in works:
                work.get_future().add_done_callback(one_done)
        except RuntimeError:  # no future: the caller's wait marks the end
            pass
        return done

    def cycle(self) -> None:
        """A negotiation round starts (marked only with mark_cycles)."""
        if self.mark_cycles:
            now = time.time()
            self._add((_CYCLES, "CYCLE_START", now, now))

    def _add(self, span: Span) -> None:
        with self._lock:
            self._keep(span)

    def _keep(self, span: Span) -> None:
        """Keep `span` (the lock held) while there is room."""
        if len(self._spans) < MAX_SPANS:
            self._spans.append(span)
        else:
            self.dropped += 1

    def spans(self) -> list[Span]:
        """What this process recorded so far."""
        with self._lock:
            return list(self._spans)


def trace_events(spans_by_rank: list[list[Span] | None]) -> list[dict[str, Any]]:
    """Every rank's spans as trace events: a process per rank, a row per operation name
    (the same row number on every rank), times from the earliest span."""
    spans = [s for rank_spans in spans_by_rank if rank_spans for s in rank_spans]
    if not spans:
        return []
    t0 = min(start for _, _, start, _ in spans)
    rows = {name: tid for tid, name in enumerate(sorted({row for row, *_ in spans}))}
    events: list[dict[str, Any]] = []
    for rank, rank_spans in enumerate(spans_by_rank):
        if not rank_spans:
            continue
        events += process_names(rank, {rows[row]: row for row in {s[0] for s in rank_spans}})
        for row, name, start, end in rank_spans:
            event = {"name": name, "cat": "horovod", "pid": rank, "tid": rows[row]}
            event["ts"] = round((start - t0) * 1e6, 3)
            if name == "CYCLE_START":
                event |= {"ph": "i", "s": "t"}
            else:
                event |= {"ph": "X", "dur": round((end - start) * 1e6, 3)}
            events.append(event)
    return events


def finish(timeline: Timeline, store: dist.Store | None, key: str, size: int) -> Path | None:
    """Stop `timeline`: each process hands its spans to rank 0 under `key` in `store`
    (None for a one-process job) and rank 0 writes the file, waiting at most
    `GATHER_WAIT_S` for the others; returns the path written on rank 0, else None."""
    mine = timeline.spans()
    if timeline.rank != 0:
        if store is not None:
            with contextlib.suppress(RuntimeError):  # rank 0 gone: nobody writes the file
                store.set(f"{key}{timeline.rank}", json.dumps(mine))
        return None
    deadline = time.monotonic() + GATHER_WAIT_S
    everyone = [mine] + [_handed_in(store, f"{key}{rank}", deadline) for rank in range(1, size)]
    path = write_events(timeline.path, trace_events(everyone))
    missing = [rank for rank, spans in enumerate(everyone) if spans is None]
    if missing:
        print(
            f"horovod: the timeline in {path} lacks rank(s) {missing}, which did not hand in "
            f"their spans within {GATHER_WAIT_S:g} s; start the timeline on every process "
            f"({TIMELINE_VAR} reaches them all).",
            flush=True,
        )
    else:
        print(f"horovod: timeline in {path} (open it in ui.perfetto.dev).", flush=True)
    if timeline.dropped:
        print(
            f"horovod: rank 0 kept its first {MAX_SPANS:,} spans and dropped "
            f"{timeline.dropped:,}; stop the timeline earlier (hvd.stop_timeline) for a "
            "complete one.",
            flush=True,
        )
    return path


def _handed_in(store: dist.Store | None, key: str, deadline: float) -> list[Span] | None:
    """The spans another process set under `key`, or None if they are not there by
    `deadline` (`time.monotonic()`)."""
    if store is None:
        return None
    try:
        store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except RuntimeError:  # the store's timeout (a DistStoreError)
        return None
    spans = [(row, name, start, end) for row, name, start, end in json.loads(store.get(key))]
    store.delete_key(key)
    return spans


def from_environment(rank: int) -> Timeline | None:
    """The timeline ``HOROVOD_TIMELINE`` asks for, if any."""
    path = os.environ.get(TIMELINE_VAR, "").strip()
    if not path:
        return None
    cycles = os.environ.get(MARK_CYCLES_VAR, "").strip() not in ("", "0")
    return Timeline(path, rank, cycles)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording Horovod's timeline into `file_path` (written by rank 0 when it
    stops; call it on every process). A timeline already running is stopped first."""
    ctx = basics.context("start_timeline")
    stop(ctx)
    ctx.engine.timeline = Timeline(file_path, ctx.rank, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline and have rank 0 write it (does nothing if none runs)."""
    stop(basics.context("stop_timeline"))


def stop(ctx: basics.Context) -> None:
    """Stop the timeline of the job `ctx` describes, if one runs (`hvd.shutdown` too)."""
    timeline, ctx.engine.timeline = ctx.engine.timeline, None
    ctx.timelines += 1  # on every process alike, running or not, so the keys agree
    if timeline is None:
        return
    key = f"dtrain/horovod/{ctx.session}/timeline/{ctx.timelines}/"
    finish(timeline, ctx.store, key, ctx.size)
