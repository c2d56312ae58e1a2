"""Metric loggers a person can look at: a CSV file and TensorBoard event files.

The Engine opens them on rank 0 only (`open_loggers`) and hands them floats it has
already read back, keyed by namespaced names (``train/loss``, ``eval/accuracy``, or a
user's own ``my_metric``). `check_loggers` runs earlier, on every rank, so a missing
package stops the job before training rather than at the first log.
"""

from __future__ import annotations

import csv
import importlib.util
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from dtrain.command_names import LOGGERS
from dtrain.errors import ConfigError

CSV_HEADER = ("step", "name", "value")
FLUSH_SECS = 30
"""How often TensorBoard's writer flushes: a person watching a run sees it this late."""


def check_loggers(names: list[str]) -> None:
    """Raise a ConfigError for an unknown logger name, or for "tensorboard" when the
    ``tensorboard`` package is missing; imports nothing heavy (safe at init on every rank)."""
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ConfigError(
            f"Unknown logger {', '.join(map(repr, unknown))}: choose from {', '.join(LOGGERS)}."
        )
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "The tensorboard logger needs the tensorboard package, which is not installed: "
            "run pip install 'dtrain[tensorboard]', or choose the csv logger."
        )


class _CsvSink:
    """``metrics.csv`` in long format: a ``step,name,value`` row per metric, so a key that
    first appears late (eval/* at an epoch's end) needs no new column."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        if path.exists():
            _cut_torn_row(path)
            if resume_step is not None:
                _drop_rows_after(path, resume_step)
        self._file = path.open("a", newline="")
        self._writer = csv.writer(self._file, lineterminator="\n")
        if self._file.tell() == 0:
            self._writer.writerow(CSV_HEADER)

    def write(self, metrics: dict[str, float], step: int) -> None:
        self._writer.writerows((step, name, value) for name, value in metrics.items())
        # To the OS at every call, so a crashed process loses no row (no fsync: too slow).
        self._file.flush()

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _cut_torn_row(path: Path) -> None:
    """Cut a last row that a crash left without its newline (rows are far below 4 KiB)."""
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 4096))
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite `path` keeping the rows of steps up to `step` (an earlier run's rows after the
    checkpoint resumed from would repeat)."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    kept = [row for row in rows if int(row[0]) <= step]
    partial = path.with_name(path.name + ".tmp")
    with partial.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([CSV_HEADER, *kept])
    partial.replace(path)


class _TensorBoardSink:
    """Event files under ``tensorboard/``, one scalar series per metric name."""

    def __init__(self, directory: Path, resume_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError(
                f"TensorBoard could not be imported ({error}): run "
                "pip install 'dtrain[tensorboard]', or choose the csv logger."
            ) from error
        # purge_step makes TensorBoard hide the earlier run's points from there on.
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(
            log_dir=str(directory), flush_secs=FLUSH_SECS, purge_step=purge
        )

    def write(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricLogger:
    """Sends each `log` call to every opened logger (none: every call does nothing).

    Values are Python numbers or one-element tensors; anything else is skipped with a
    warning. NaN and infinities are logged as they are (``nan``, ``inf`` in the CSV), since
    a non-finite gradient norm is worth seeing.
    """

    def __init__(self, sinks: list[_CsvSink | _TensorBoardSink]) -> None:
        self._sinks = sinks

    def log(self, metrics: Mapping[str, float | torch.Tensor], step: int) -> None:
        """Record `metrics` (name to value) at optimizer step `step`."""
        values = {}
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, numbers.Real):
                values[name] = float(value)
            else:
                warnings.warn(
                    f"Metric {name!r} is a {type(value).__name__}, not a number, so it was not "
                    "logged: pass a float or a one-element tensor.",
                    stacklevel=2,
                )
        if values:
            for sink in self._sinks:
                sink.write(values, int(step))

    def flush(self) -> None:
        """Push what was logged to disk."""
        for sink in self._sinks:
            sink.flush()

    def close(self) -> None:
        """Flush and close every logger; later calls do nothing."""
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def open_loggers(names: list[str], directory: Path, resume_step: int | None = None) -> MetricLogger:
    """Open the loggers `names` under `directory`: ``metrics.csv`` (csv) and
    ``tensorboard/`` (tensorboard). Both continue an earlier run's files.

    With `resume_step` (the step of the checkpoint a run resumes from), the earlier run's
    points after it are dropped: rewritten out of the CSV, hidden by TensorBoard. Without
    it, steps logged twice appear twice; a reader should keep the last row per step and name.
    """
    check_loggers(names)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sinks: list[_CsvSink | _TensorBoardSink] = []
    # TensorBoard first: its import can still fail, and then no CSV file is left open.
    if "tensorboard" in names:
        sinks.append(_TensorBoardSink(directory / "tensorboard", resume_step))
    if "csv" in names:
        sinks.append(_CsvSink(directory / "metrics.csv", resume_step))
    return MetricLogger(sinks)
