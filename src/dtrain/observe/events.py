"""Step events: what the Engine tells the code that watches its steps.

The Engine runs a step (the strategy's forward and backward, the clipping, the
optimizer's step) and says what happens, in order, to an ordered list of observers: the
loss reads, the memory report, the step timing, the end-of-run summary. Each observer
keeps its own state and does its own bookkeeping in these hooks, so the step itself holds
none. Every hook runs on the host in the step's hot path: none may make the host wait
for the device (the loss is handed over as a device tensor; reading it is the loss
reads' business, every few steps).

One `train_step` fires, in order::

    on_step_start(step)
      (on_micro_start(batch), on_micro_end()) for each micro-batch
      on_gradients(step, loss)
      [on_grad_norm(norm)]                      with --clip-grad-norm
    on_step_end(step, loss)                     always: loss None when the step raised

A hand-written loop fires ``on_backward_start(step, loss)`` / ``on_backward_end()``
around each `engine.backward`, and ``on_loop_step(step)`` after each optimizer step it
takes itself (not `train_step`'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Run:
    """What `engine.setup` built, as observers see it.

    Args:
        module: the user's model, unwrapped (the parameters this rank holds).
        model: the module the loop calls (the strategy's wrapper).
        optimizer: the optimizer the loop steps, if any.
        group: every process of the training loop (collectives at the end of the run).
        lockstep: every training process takes each step together, so per-step reads
            may be collective over `group`.
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    group: dist.ProcessGroup | None
    lockstep: bool


@dataclass
class End:
    """The end of the run, as `engine.close` reports it.

    Args:
        together: every rank reached the end (not on an error): collectives are allowed.
        steps: optimizer steps taken.
        last_checkpoint: the newest checkpoint this process saw complete.
        results: the metrics JSON being built; observers add their keys in turn.
    """

    together: bool
    steps: int
    last_checkpoint: Path | None
    results: dict[str, Any] = field(default_factory=dict)


class Observer:
    """Something that watches the Engine's steps; every hook does nothing until overridden."""

    def on_setup(self, run: Run) -> None:
        """`engine.setup` placed the model and built the optimizer."""

    def on_step_start(self, step: int) -> None:
        """`train_step` starts optimizer step `step` (1-based)."""

    def on_micro_start(self, batch: Any) -> None:
        """A micro-batch (on the device) goes into the strategy's forward and backward."""

    def on_micro_end(self) -> None:
        """The micro-batch's backward (with its gradient synchronisation) returned."""

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        """Every micro-batch of `train_step`'s step `step` is done; `loss` is the batch's
        mean loss on the device. The clipping and the optimizer's step come next."""

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        """The gradients were clipped; `norm` is their norm before it, on the device."""

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        """`train_step`'s step `step` is over: `loss` as in `on_gradients`, or None when the
        step raised (fired whatever happened)."""

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        """A hand-written loop's `engine.backward` of `loss`, the loss of step `step`."""

    def on_backward_end(self) -> None:
        """A hand-written loop's backward returned."""

    def on_loop_step(self, step: int) -> None:
        """A hand-written loop's optimizer step made step `step` (counted already)."""

    def on_resume(self, step: int) -> None:
        """A checkpoint was loaded: training goes on after step `step`."""

    def on_close(self, end: End) -> None:
        """The run ends; add to ``end.results`` what this observer reports."""


class Observers:
    """The Engine's observers, told every event in list order.

    The order matters: the loss reads come before the timing, so that a read at
    ``on_gradients`` is not counted in the optimizer phase; the timing before the memory
    report, whose work in its (first) step is then not timed as the step's; the summary
    last, as it reads what the others added to the results and writes them.
    """

    def __init__(self, observers: list[Observer]) -> None:
        self._observers = list(observers)
        self._in_step = False
        """Between a `train_step`'s on_step_start and on_step_end."""

    def append(self, observer: Observer) -> None:
        """Tell `observer` every event from now on, after the others."""
        self._observers.append(observer)

    def on_setup(self, run: Run) -> None:
        for o in self._observers:
            o.on_setup(run)

    def on_step_start(self, step: int) -> None:
        self._in_step = True
        for o in self._observers:
            o.on_step_start(step)

    def on_micro_start(self, batch: Any) -> None:
        for o in self._observers:
            o.on_micro_start(batch)

    def on_micro_end(self) -> None:
        for o in self._observers:
            o.on_micro_end()

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        for o in self._observers:
            o.on_gradients(step, loss)

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        for o in self._observers:
            o.on_grad_norm(norm)

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        self._in_step = False
        for o in self._observers:
            o.on_step_end(step, loss)

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        for o in self._observers:
            o.on_backward_start(step, loss)

    def on_backward_end(self) -> None:
        for o in self._observers:
            o.on_backward_end()

    def on_optimizer_step(self, step: int) -> None:
        """An optimizer step made step `step`: a hand-written loop's (`on_loop_step`)
        unless it is `train_step`'s own, whose events are its step's."""
        if self._in_step:
            return
        for o in self._observers:
            o.on_loop_step(step)

    def on_resume(self, step: int) -> None:
        for o in self._observers:
            o.on_resume(step)

    def on_close(self, end: End) -> None:
        for o in self._observers:
            o.on_close(end)
