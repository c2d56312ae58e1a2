"""The end of a run: the metrics JSON's run-wide figures (global batch, samples/s, fp16
skips) written through the report, and the line the main rank prints last."""

from __future__ import annotations

import torch

from dtrain.config import Config
from dtrain.observe.events import End, Observer
from dtrain.observe.progress import Throughput, steady_rate
from dtrain.observe.run_report import RunReport
from dtrain.observe.timing import RunTiming
from dtrain.step.position import Position
from dtrain.step.precision import LossScaling


class RunSummary(Observer):
    """Counts each step's global batch and, at the end, completes and writes the results.

    It comes after the observers whose results it reads (the timing's breakdown gives
    samples/s to a loop without `engine.progress`).

    Args:
        config: the run's options (``grad_compression``).
        report: writes the metrics JSON.
        throughput: samples and seconds counted by `engine.progress`.
        position: where training stands (the epoch's global batch).
        timing: counts the samples of a hand-written loop's forwards.
        loss_scaling: fp16-mixed's loss scale, or None.
        dp_size: data-parallel processes (a worker's batch times this is the global one).
        is_main: True on the rank that prints.
    """

    def __init__(
        self,
        config: Config,
        report: RunReport,
        throughput: Throughput,
        position: Position,
        timing: RunTiming,
        loss_scaling: LossScaling | None,
        dp_size: int,
        is_main: bool,
    ) -> None:
        self.grad_compression = config.grad_compression
        self.report = report
        self.throughput = throughput
        self.position = position
        self.timing = timing
        self.loss_scaling = loss_scaling
        self.dp_size = dp_size
        self.is_main = is_main
        self._step_samples = 0
        """Samples of the last step over every data-parallel worker."""
        self._batch = 0
        """Samples of the running `train_step` on this worker, micro-batch by micro-batch."""

    def on_step_start(self, step: int) -> None:
        self._batch = 0

    def on_micro_start(self, samples: int) -> None:
        self._batch += samples

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        self._step_samples = self._batch * self.dp_size

    def on_loop_step(self, step: int) -> None:
        # A hand-written loop: its step's samples are those its forwards computed.
        samples = self.timing.take_forward_samples() * self.dp_size
        self._step_samples = samples or self._step_samples

    def on_close(self, end: End) -> None:
        results = end.results
        # The epoch's global batch (engine.progress), else what the steps saw.
        batch = self.position.samples_per_step or self._step_samples
        if batch:
            results["global_batch_size"] = batch
        rate = self.throughput.samples_per_second
        if not self.throughput.seconds:
            rate = steady_rate(results) or rate  # a loop without engine.progress
        results["samples_per_second"] = rate
        scaling = self.loss_scaling
        if scaling is not None:
            results["skipped_steps"] = scaling.skipped
            results["loss_scale"] = scaling.scale_value
        if self.grad_compression != "none":
            results["grad_compression"] = self.grad_compression
        metrics_path = self.report.finish(results)
        if not (end.steps and self.is_main):
            return
        skipped = scaling.skipped if scaling is not None else 0
        print(
            f"dtrain: {end.steps} steps"
            + (f" ({skipped} skipped: fp16 gradients overflowed)" if skipped else "")
            + (f", {rate:,.0f} samples/s" if rate else "")
            + (f", last checkpoint {end.last_checkpoint}" if end.last_checkpoint else "")
            + (f", metrics in {metrics_path}" if metrics_path else "")
            + ".",
            flush=True,
        )
