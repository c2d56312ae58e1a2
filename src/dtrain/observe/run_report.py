"""What a run reports beyond the progress bar: metric logs every few steps (CSV,
TensorBoard) and the results JSON written when the script ends, on the main rank."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.config import Config
from dtrain.observe.events import Observer
from dtrain.observe.metrics import write_metrics

if TYPE_CHECKING:
    from dtrain.observe.loggers import MetricLogger

DEFAULT_OUT = "runs/dtrain"
"""Where `dtrain run` writes logs and metrics when --out is not given."""


class RunReport(Observer):
    """The main rank's metric logs and results; on other ranks every call does nothing.

    Args:
        config: the run's options (``logger``, ``out``, ``metrics_json``).
        is_main: True on the rank that writes.
    """

    def __init__(self, config: Config, is_main: bool) -> None:
        self.is_main = is_main
        self.out = Path(config.out or DEFAULT_OUT)
        self.metrics_json = Path(config.metrics_json) if config.metrics_json else None
        self.started = time.perf_counter()
        self.results: dict[str, Any] = {}
        """Keys the script adds to (or overrides in) the metrics JSON."""
        self._resumed_at: int | None = None
        """The step a loaded checkpoint ended at: an earlier run's points after it are
        dropped from the logs when they are opened."""
        self._names = config.logger if is_main else None
        self._logger: MetricLogger | None = None
        if config.logger:
            from dtrain.observe.loggers import check_loggers

            check_loggers(config.logger)  # every rank: a missing package stops them all

    def on_resume(self, step: int) -> None:
        self._resumed_at = step

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write `metrics` (name -> number) at `step` to the metric logs (opened at the
        first call, after any checkpoint was loaded)."""
        if not self._names:
            return
        if self._logger is None:
            # Imported only when asked for: TensorBoard's writer is slow to import.
            from dtrain.observe.loggers import open_loggers

            self._logger = open_loggers(self._names, self.out, self._resumed_at)
        self._logger.log(metrics, step)

    def finish(self, engine_results: dict[str, Any]) -> Path | None:
        """Close the logs and write the metrics JSON (the Engine's results, then the
        script's); return the JSON's path when one was written."""
        if self._logger is not None:
            self._logger.close()
        self._names = None
        if not (self.is_main and self.metrics_json):
            return None
        metrics = {
            **engine_results,
            "wall_seconds": time.perf_counter() - self.started,
            **self.results,
        }
        write_metrics(self.metrics_json, {k: _json_number(v) for k, v in metrics.items()})
        return self.metrics_json


def _json_number(value: Any) -> Any:
    """JSON has no NaN or infinity: such floats become null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
