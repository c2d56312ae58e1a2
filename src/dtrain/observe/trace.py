"""The job's trace: one Chrome/Perfetto JSON file for every rank (``--trace FILE``).

The trace-event format is the one chrome://tracing and ui.perfetto.dev read: complete
events (``"ph": "X"``) with a start and a duration in microseconds. Each rank is a process
(``pid`` = rank, named "rank R"); its spans are the phases of `dtrain.observe.breakdown`
on the clock all ranks set to zero together at setup.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dtrain.observe.breakdown import Span


def process_names(rank: int, threads: dict[int, str]) -> list[dict[str, Any]]:
    """The metadata events that name rank `rank`'s process ("rank R") and its threads
    (tid -> name)."""
    named = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    return named + [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for tid, name in threads.items()
    ]


def trace_events(spans_by_rank: list[list[Span]]) -> list[dict[str, Any]]:
    """The trace events of every rank's spans, with a name for each rank's process."""
    events: list[dict[str, Any]] = []
    for rank, spans in enumerate(spans_by_rank):
        events += process_names(rank, {0: "train"})
        events += [
            {
                "name": phase,
                "cat": "step",
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": round(start * 1e6, 3),
                "dur": round(duration * 1e6, 3),
                "args": {"step": step},
            }
            for phase, step, start, duration in spans
        ]
    return events


def write_events(path: str | Path, events: list[dict[str, Any]]) -> Path:
    """Write trace `events` to `path` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    partial.replace(path)
    return path


def write_trace(path: str | Path, spans_by_rank: list[list[Span]]) -> Path:
    """Write the trace of every rank's step spans to `path`."""
    return write_events(path, trace_events(spans_by_rank))


def traced_steps(path: Path, spans_by_rank: list[list[Span]], window: tuple[int, int]) -> str:
    """The line that says which steps the trace at `path` holds, numbered as its events
    and the progress bar number them (from 1); `window` is ``--trace-steps A:B``."""
    steps = {step for spans in spans_by_rank for _, step, _, _ in spans}
    if not steps:
        first, last = window
        return (
            f"dtrain: the trace in {path} holds no step: the run ended before step "
            f"{first + 1}, where --trace-steps {first}:{last} starts; choose a window inside "
            "the run, such as --trace-steps 0:10."
        )
    return (
        f"dtrain: trace of steps {min(steps)} to {max(steps)} in {path} (open it in "
        "ui.perfetto.dev)."
    )
