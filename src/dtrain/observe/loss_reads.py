"""The Engine's loss reads: the watched loss read back at the log interval (a collective
under synchronous strategies), the non-finite check, and the training scalars of the
metric logs written at each read."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dtrain.errors import NonFiniteLossError
from dtrain.observe.breakdown import StepTimer
from dtrain.observe.loss import LossWatch
from dtrain.observe.progress import Throughput
from dtrain.observe.report import RunReport


class LossReads:
    """Reads of the watched loss, and what each read writes to the logs.

    Args:
        watch: the losses kept on the device between reads.
        report: the metric logs (main rank).
        throughput: samples/s for the logs.
        timer: the step timer, whose marks are done once a read has waited for the device.
    """

    def __init__(
        self, watch: LossWatch, report: RunReport, throughput: Throughput, timer: StepTimer
    ) -> None:
        self.watch = watch
        self.report = report
        self.throughput = throughput
        self.timer = timer

    def read(
        self,
        group: dist.ProcessGroup | None,
        lockstep: bool,
        optimizer: torch.optim.Optimizer | None,
        grad_norm: torch.Tensor | None,
    ) -> float | None:
        """Read the watched loss back from the device (a collective over `group` when the
        strategy's ranks step in `lockstep`) and log it; on a non-finite loss, clear the
        gradients and raise."""
        watch = self.watch
        fresh = watch.unread
        try:
            loss = watch.read(group, lockstep and dist.is_initialized())
        except NonFiniteLossError:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            raise
        if fresh and loss is not None and self.report.is_main:
            self._log(loss, watch.last_step, optimizer, grad_norm)
        self.timer.collect()  # the read waited for the device: the marks are done
        return loss

    def _log(
        self,
        loss: float,
        step: int,
        optimizer: torch.optim.Optimizer | None,
        grad_norm: torch.Tensor | None,
    ) -> None:
        metrics = {
            "train/loss": loss,
            "train/samples_per_second": self.throughput.samples_per_second,
        }
        if optimizer is not None:
            metrics["train/lr"] = float(optimizer.param_groups[0]["lr"])
        norm = float(grad_norm) if grad_norm is not None else math.nan
        if math.isfinite(norm):  # sync ps clips on the servers, which keep the norm
            metrics["train/grad_norm"] = norm
        self.report.log(metrics, step)
