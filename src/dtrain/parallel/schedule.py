"""The `torch.distributed.pipelining` pieces a `dtrain.parallel.pipeline.Pipeline` runs: a
stage that times its own compute, and the schedule by name.

Kept apart from the pipeline's own logic because importing torch's pipelining pulls in its
compiler (a second or more per process); only a run with a pipeline imports this module.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule


@contextlib.contextmanager
def untouched(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside the block `module` may run: afterwards its buffers (running statistics,
    counters) hold their values from before and the random number generators their
    states. Plain Python attributes changed by a forward are not restored."""
    saved = [
        (owner, name, buffer.detach().clone())
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False)
    ]
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        yield
    # The copies taken before go back in place of the buffers, not into them: autograd
    # saved some buffers (BatchNorm's running statistics) for the backward that torch
    # infers next, and writing into them would fail that backward's version check.
    for owner, name, value in saved:
        setattr(owner, name, value)


class TimedStage(PipelineStage):
    """A pipeline stage that adds up the time it computes (each micro-batch's forward and
    backward), so the idle time of the stage, and any imbalance between stages, can be
    told apart from its work. On GPUs it records CUDA events, read once a step is over.
    The output of the step's last micro-batch is handed to `watch` (the step timing's
    hook on the backward through it, the stage's last)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.watch: Callable[[torch.Tensor], object] | None = None

    def _begin(self) -> Any:
        """The start of a timed run: a recorded CUDA event on a GPU, else the host time."""
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _end(self, start: Any) -> None:
        """The timed run begun at `start` ended: its time is counted (on a GPU, once the
        device has done it)."""
        if isinstance(start, float):
            self.seconds += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end))

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # torch learns the activation shapes at the first step by a training-mode forward
        # of the first micro-batch (of uninitialised tensors past the first stage): one
        # the unsplit model never runs, so it must leave no trace in buffers or RNG draws.
        with untouched(self.submod, self.device):
            return super()._forward_metadata_inference(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = self._begin()
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._end(start)
        last = self.chunks is not None and fwd_chunk_id == self.chunks - 1  # last backward
        if last and self.watch is not None:
            first = output[0] if isinstance(output, tuple | list) else output
            if isinstance(first, torch.Tensor):
                self.watch(first)
        return output

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = self._begin()
        result = super().backward_one_chunk(*args, **kwargs)
        self._end(start)
        return result

    def take_seconds(self, wait: bool = False) -> float:
        """Compute seconds since the last call. On GPUs only the micro-batches the device
        has finished are counted (the rest at a later call), unless `wait`: the step never
        waits for the device to read its timers."""
        pending = []
        for start, end in self._events:
            if wait or end.query():
                end.synchronize()
                self.seconds += start.elapsed_time(end) / 1000
            else:
                pending.append((start, end))
        self._events = pending
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def schedule_for(
    schedule: str, stages: list[TimedStage], microbatches: int, **options: Any
) -> _PipelineSchedule:
    """torch's schedule named `schedule` (gpipe, 1f1b or interleaved) over this rank's
    `stages` (several only when interleaved)."""
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, microbatches, **options)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return kind(stages[0], microbatches, **options)
