"""The Engine's loss reads: the watched loss read back at the log interval (under
synchronous strategies a collective over the ranks whose losses differ), the non-finite
check, the training scalars of the metric logs written at each read (a train_step's at
the end of its step), and at the end a loss that jumped up named (loss_jump.py)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dtrain import advice
from dtrain.errors import NonFiniteLossError
from dtrain.observe.breakdown import StepTimer
from dtrain.observe.events import End, Observer, Run
from dtrain.observe.loss import LossWatch
from dtrain.observe.loss_jump import LossCourse
from dtrain.observe.progress import Throughput
from dtrain.observe.run_report import RunReport
from dtrain.process.logs import LOGGER


class LossReads(Observer):
    """Each step's loss, watched on the device and read back every `log_every` steps
    (before that step's update, so that a non-finite loss never reaches the parameters),
    and what each read writes to the logs.

    Args:
        log_every: steps between reads (--log-every).
        report: the metric logs (main rank).
        throughput: samples/s for the logs.
        timer: the step timer, whose marks are done once a read has waited for the device.
    """

    def __init__(
        self, log_every: int, report: RunReport, throughput: Throughput, timer: StepTimer
    ) -> None:
        self.log_every = log_every
        self.watch = LossWatch()
        self.report = report
        self.throughput = throughput
        self.timer = timer
        self.grad_norm: torch.Tensor | None = None
        """The gradient norm before the last clipping (on the device), for the logs."""
        self.course = LossCourse()
        """The loss's course over the run, window by window."""
        self._resumed = False
        self._run: Run | None = None
        self._pending: tuple[dict[str, float], int] | None = None
        """A read's metrics and step, not yet written to the logs."""
        self._settle_at_end = False
        """A train_step's read left its logging for the end of the step."""

    @property
    def last(self) -> float | None:
        """The last loss read back (what the progress bar shows)."""
        return self.watch.last

    def on_setup(self, run: Run) -> None:
        self._run = run

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        self.watch.record(loss, step)
        if step % self.log_every == 0:
            # Before the update: a non-finite loss never reaches it. The logging waits for
            # the end of the step, so that a GPU has the update's work queued meanwhile
            # rather than idling after the read's wait.
            self.read(later=True)
            self._settle_at_end = True

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        if self._settle_at_end:
            self._settle_at_end = False
            self._settle()

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        self.grad_norm = norm

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        self.watch.record(loss, step)

    def on_loop_step(self, step: int) -> None:
        if step % self.log_every == 0:
            self.read()  # read after its step

    def on_resume(self, step: int) -> None:
        self._resumed = True

    def on_close(self, end: End) -> None:
        end.results["train_loss"] = self.watch.last
        jump = None if self._resumed else self.course.jump
        if jump is None or not self.report.is_main:
            return
        message = jump.message(advice.unstable_loss())
        LOGGER.info(message)  # printed below: no warning, which would say it twice
        print(f"dtrain: note: {message}", flush=True)
        end.results["loss_jump"] = {
            "from_step": jump.low_step,
            "from": jump.low,
            "to_step": jump.high_step,
            "to": jump.high,
            "first": jump.first,
            "message": message,
        }

    def flush(self) -> None:
        """Read the losses recorded since the last read, if any (before a checkpoint is
        written or left, and at the end of an epoch)."""
        if self.watch.unread:
            self.read()

    def read(self, later: bool = False) -> float | None:
        """Read the watched loss back from the device (a collective over the processes
        whose losses differ, `Run.loss_group`, when they step in lockstep) and log it
        (with `later`, at the end of the step); on a non-finite loss, clear the gradients
        and raise."""
        run = self._run
        optimizer = run.optimizer if run is not None else None
        group, distributed = None, False
        if run is not None and run.lockstep and dist.is_initialized():
            group = run.group if run.loss_group is None else run.loss_group
            distributed = dist.get_world_size(group) > 1
        watch = self.watch
        fresh = watch.unread
        try:
            loss = watch.read(group, distributed)
        except NonFiniteLossError:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            raise
        if fresh and loss is not None:
            self.course.add(watch.last_step, *watch.interval)
            if self.report.is_main:
                self._pending = (self._metrics(loss, optimizer), watch.last_step)
        if not later:
            self._settle()
        return loss

    def _settle(self) -> None:
        """Write the last read's metrics, with the gradient norm of the step it read (a
        train_step clips after its read: hence at the step's end), and turn the step marks
        the read made ready into seconds (it waited for the device)."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                metrics, step = pending
                norm = float(self.grad_norm) if self.grad_norm is not None else math.nan
                if math.isfinite(norm):  # sync ps clips on the servers, which keep the norm
                    metrics["train/grad_norm"] = norm
                self.report.log(metrics, step)
        finally:
            self.timer.collect()

    def _metrics(self, loss: float, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        metrics = {
            "train/loss": loss,
            "train/samples_per_second": self.throughput.samples_per_second,
        }
        if optimizer is not None:
            metrics["train/lr"] = float(optimizer.param_groups[0]["lr"])
        return metrics
