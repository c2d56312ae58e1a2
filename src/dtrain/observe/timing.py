"""The Engine's side of the step breakdown, an observer of its step events: start the
clocks together at setup, mark the phases, and at the end gather every rank's medians,
diagnose, print, trace.

Everything per step only records marks (`dtrain.observe.breakdown`); the only
collectives are one barrier at setup (to align the ranks' clocks) and one gather at the
end of the run.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import Config, step_window
from dtrain.errors import SetupError
from dtrain.observe.breakdown import StepTimer
from dtrain.observe.clock import clock_for
from dtrain.observe.diagnosis import Job, Reading, diagnose, table
from dtrain.observe.events import End, Observer, Run
from dtrain.observe.trace import traced_steps, write_trace
from dtrain.process.collectives import barrier, gather_objects
from dtrain.process.logs import LOGGER
from dtrain.step.batches import batch_size


class RunTiming(Observer):
    """One rank's step timer and what the run makes of it at the end.

    Args:
        config: the run's options (``trace``, ``trace_steps``).
        device: where this rank computes (CUDA events there, host time otherwise).
        is_main: True on the rank that prints the breakdown at the end.
        exchange_in_step: the optimizer step is the gradient exchange (parameter servers).
        exchange_after_backward: a backward goes on after autograd's pass (DDP's, FSDP's,
            towers' or a pipeline's gradients): the pass's end is marked. Otherwise
            backward ends with the pass, and no backward is watched.
    """

    def __init__(
        self,
        config: Config,
        device: torch.device,
        is_main: bool,
        exchange_in_step: bool,
        exchange_after_backward: bool,
    ) -> None:
        self.device = device
        self.exchange_after_backward = exchange_after_backward
        self.is_main = is_main
        self.trace_path = Path(config.trace) if config.trace else None
        window = step_window(config.trace_steps) if self.trace_path else None
        self.timer = StepTimer(clock_for(device), exchange_in_step, window)
        self.grad_accumulation = config.grad_accumulation
        self.job = Job(
            config.strategy,
            config.nnodes,
            config.hierarchical,
            config.grad_compression,
            # The 16-bit format to advise: fp16 on GPUs without bf16.
            "fp16" if device.type == "cuda" and not torch.cuda.is_bf16_supported() else "bf16",
            config.cp,
            config.ep,
        )
        self.per_device_batch: int | None = None
        """Samples one device computes per micro-batch, once a step has run."""
        self.reading: Reading | None = None
        """How the loader the loop trains from reads (`reads_from`), for the data advice."""
        self._forward_samples = 0
        self._group: dist.ProcessGroup | None = None

    def reads_from(self, loader: Any, local_processes: int) -> None:
        """Note how `loader` (a DataLoader the loop trains from) reads, on a machine that
        runs `local_processes` training processes."""
        self.reading = Reading(
            num_workers=getattr(loader, "num_workers", 0),
            cores=max(1, _cores() // max(1, local_processes)),
            unpinned=self.device.type == "cuda" and not getattr(loader, "pin_memory", False),
        )

    def listens_to(self, event: str) -> bool:
        return event != "on_grad_ready" or self.exchange_after_backward

    # -- the step events --------------------------------------------------------------
    def on_setup(self, run: Run) -> None:
        """Align the ranks' clocks (a barrier over the training processes)."""
        self._group = run.group
        barrier(run.group)
        self.timer.clock.restart()

    def on_step_start(self, step: int) -> None:
        self.timer.begin_step(step)

    def on_micro_start(self, samples: int) -> None:
        self.per_device_batch = samples
        self.timer.begin_micro()

    def on_forward_end(self) -> None:
        self.timer.forward_done()

    def on_grad_ready(self) -> None:
        self.timer.grad_ready()

    def on_collective_start(self) -> None:
        self.timer.collective_begin()

    def on_collective_end(self) -> None:
        self.timer.collective_end()

    def on_micro_end(self) -> None:
        self.timer.end_micro()

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        self.timer.optimizer_mark()  # clipping and the optimizer's step

    def on_optimizer_start(self) -> None:
        self.timer.optimizer_mark()

    def on_optimizer_end(self, step: int) -> None:
        self.timer.optimizer_mark()

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        self.timer.forward_done()

    def on_backward_end(self) -> None:
        self.timer.end_micro()

    def on_loop_step(self, step: int) -> None:
        # A hand-written loop's steps run from one optimizer step to the next.
        self.timer.begin_step(step + 1)

    def on_close(self, end: End) -> None:
        if end.together:  # the gather needs every rank
            end.results.update(self.finish(self._group, self.is_main))

    def on_forward_start(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        """Time the forwards of a hand-written loop: each call of the model with gradients
        enabled opens a micro-batch, unless one is open (an earlier call before the same
        backward), and counts its samples; `engine.backward` closes it. So a hand step's
        forward runs from the call of the model (before any hook of its own, so that
        gathering sharded parameters counts, as in `train_step`) to `engine.backward`, the
        loss included."""
        if not torch.is_grad_enabled() or self.timer.in_micro:
            return  # an evaluation, or a forward inside an open micro-batch
        self.timer.begin_micro()
        samples = _samples(call)
        if samples:
            self.per_device_batch = samples
            self._forward_samples += samples

    def take_forward_samples(self) -> int:
        """Samples this process's hand-written forwards computed since the last call: the
        batch size of each micro-batch (the first dimension its tensors share; 0 where
        they share none)."""
        samples, self._forward_samples = self._forward_samples, 0
        return samples

    def finish(self, group: dist.ProcessGroup | None, is_main: bool) -> dict[str, Any]:
        """Gather every rank's breakdown (a collective over `group`); on the main rank,
        print the table and the diagnosis, write the trace, and return the metrics JSON's
        ``breakdown`` and ``diagnosis``; elsewhere, or with no finished steps, {}."""
        timer = self.timer
        timer.collect(final=True)
        mine = {
            "breakdown": timer.medians(),
            "spans": timer.spans if self.trace_path else [],
            "memory": self._memory(),
            "peak": self._peak_bytes(),
        }
        everyone = gather_objects(mine, group) if dist.is_initialized() else [mine]
        if not is_main:
            return {}
        if self.trace_path is not None and timer.trace_window is not None:
            spans = [r["spans"] for r in everyone]
            path = write_trace(self.trace_path, spans)
            print(traced_steps(path, spans, timer.trace_window), flush=True)
        breakdown = [r["breakdown"] for r in everyone]
        if any(b is None for b in breakdown):
            return {}
        memory = [r["memory"] for r in everyone]
        causes = diagnose(
            breakdown,
            self.per_device_batch,
            memory,
            self.grad_accumulation,
            job=self.job,
            reading=self.reading,
        )
        text = table(breakdown, causes)
        LOGGER.info(text)
        print(text, flush=True)
        return {
            "breakdown": breakdown,
            "diagnosis": causes,
            "peak_memory_bytes": [r["peak"] for r in everyone],
        }

    def _peak_bytes(self) -> int:
        """This rank's peak memory: reserved on its GPU, else the process's resident set."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def _memory(self) -> tuple[int, int] | None:
        """(peak bytes reserved, the device's bytes) on a GPU; None elsewhere."""
        if self.device.type != "cuda":
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        return torch.cuda.max_memory_reserved(self.device), total


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def _samples(call: Any) -> int:
    """The samples in a model's call arguments, as `train_step` counts a batch's (the first
    dimension their tensors share); 0 where they share none, which leaves them uncounted."""
    try:
        return batch_size(call)
    except SetupError:
        return 0
