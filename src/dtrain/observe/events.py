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
      for each micro-batch:
        on_micro_start(samples)
          on_forward_end()                      the strategy's forward computed the loss
          on_grad_ready()                       its backward computed every gradient
        on_micro_end()
      on_gradients(step, loss)
      [on_grad_norm(norm)]                      with --clip-grad-norm
      on_optimizer_start(), on_optimizer_end(step)   around the optimizer's step (both,
                                                     back to back, after a step that
                                                     fp16-mixed skipped)
    on_step_end(step, loss)                     always: loss None when the step raised

A hand-written loop fires ``on_backward_start(step, loss)`` / ``on_backward_end()``
around each `engine.backward` (with ``on_grad_ready()`` in between), the optimizer pair
around each ``optimizer.step()`` it takes itself, then ``on_loop_step(step)``; once its
first backward has shown there is such a loop, each call of the model fires
``on_forward_start(call)`` first.

The dispatcher, `Observers`, is what torch calls back: it hooks the optimizer's step and
the model's forward once, at setup, and each micro-batch's loss (one hook a backward,
not one per parameter), and tells the observers; an observer registers no hook of its
own on the step's path (the memory report's one forward hook, for its one measured step,
aside).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle


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
        loss_group: the processes whose losses differ (each computed other samples: the
            data-parallel ones, with context parallelism their context ranks too), over
            which a per-step read of the loss is collective; None: `group`. Where it holds
            one process, every rank's loss is the global batch's already (tensor and
            pipeline ranks hold copies), and a read needs no collective.
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    group: dist.ProcessGroup | None
    lockstep: bool
    loss_group: dist.ProcessGroup | None = None


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

    def on_micro_start(self, samples: int) -> None:
        """A micro-batch of `samples` samples (on the device) goes into the strategy's
        forward and backward."""

    def on_forward_start(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        """A hand-written loop called the model (`call`: its positional and keyword
        arguments), with gradients enabled or not; fired from the loop's first
        `engine.backward` on, before the model's own hooks."""

    def on_forward_end(self) -> None:
        """`train_step`'s micro-batch has its loss: its backward starts."""

    def on_grad_ready(self) -> None:
        """A backward computed every gradient: autograd's pass is over, the strategy's wait
        for their synchronisation (DDP's last buckets, FSDP's reduce-scatters) is not
        (once per backward: per micro-batch, per pipeline chunk)."""

    def on_collective_start(self) -> None:
        """A collective inside the micro-batch's forward or backward starts (context
        parallelism's gathers of keys and values): its time is communication."""

    def on_collective_end(self) -> None:
        """The collective `on_collective_start` announced returned."""

    def on_micro_end(self) -> None:
        """The micro-batch's backward (with its gradient synchronisation) returned."""

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        """Every micro-batch of `train_step`'s step `step` is done; `loss` is the batch's
        mean loss on the device. The clipping and the optimizer's step come next."""

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        """The gradients were clipped; `norm` is their norm before it, on the device."""

    def on_optimizer_start(self) -> None:
        """The optimizer's step starts (`train_step`'s or a hand-written loop's)."""

    def on_optimizer_end(self, step: int) -> None:
        """The optimizer's step made step `step` (counted already)."""

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        """`train_step`'s step `step` is over: `loss` as in `on_gradients`, or None when the
        step raised (fired whatever happened)."""

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        """A hand-written loop's `engine.backward` of `loss`, the loss of step `step`."""

    def on_backward_end(self) -> None:
        """A hand-written loop's backward returned."""

    def on_loop_step(self, step: int) -> None:
        """A hand-written loop's optimizer step made step `step` (after
        `on_optimizer_end`)."""

    def on_resume(self, step: int) -> None:
        """A checkpoint was loaded: training goes on after step `step`."""

    def on_close(self, end: End) -> None:
        """The run ends; add to ``end.results`` what this observer reports."""

    def listens_to(self, event: str) -> bool:
        """Whether this observer wants `event` (the name of a hook it overrides), asked
        once, as it joins the Engine's list (for observers given to the Engine when it is
        built, before `on_setup`: the answer must depend only on what the observer was
        built with): an observer with nothing to do on a hook in this run says no, and
        the step's hot path loses the call (and, for ``on_grad_ready``, the watch of every
        backward)."""
        return True


EVENTS = tuple(name for name in vars(Observer) if name.startswith("on_"))
"""The names of the hooks an observer may override."""


class Observers:
    """The Engine's observers, told every event in list order.

    The order matters: the data position moves first, so that a checkpoint saved at a
    step records what the step trained; the loss reads come before the timing, so that a read at
    ``on_gradients`` is not counted in the optimizer phase; the timing before the memory
    report, whose work in its (first) step is then not timed as the step's; the summary
    last, as it reads what the others added to the results and writes them.

    Each event calls only the observers that override its hook and want it
    (`Observer.listens_to`): the events run on the step's hot path, where a call that
    does nothing still costs its time.
    """

    def __init__(self, observers: list[Observer]) -> None:
        self._hooks: dict[str, list[Callable[..., None]]] = {name: [] for name in EVENTS}
        """Each event's overridden hooks, in list order."""
        for o in observers:
            self.append(o)
        self._in_step = False
        """Between a `train_step`'s on_step_start and on_step_end."""
        self._optimizing = False
        """Between the optimizer's step pre-hook and the step's count."""
        self._model: torch.nn.Module | None = None
        self._forwards: RemovableHandle | None = None

    def append(self, observer: Observer) -> None:
        """Tell `observer` every event it overrides and wants from now on, after the
        others."""
        for name, hooks in self._hooks.items():
            overridden = getattr(type(observer), name) is not getattr(Observer, name)
            if overridden and observer.listens_to(name):
                hooks.append(getattr(observer, name))

    def on_setup(self, run: Run) -> None:
        """Hook the optimizer's step, then tell the observers."""
        self._model = run.model
        if run.optimizer is not None:
            run.optimizer.register_step_pre_hook(self._optimizer_start)
        for hook in self._hooks["on_setup"]:
            hook(run)

    def on_step_start(self, step: int) -> None:
        self._in_step = True
        for hook in self._hooks["on_step_start"]:
            hook(step)

    def on_micro_start(self, samples: int) -> None:
        for hook in self._hooks["on_micro_start"]:
            hook(samples)

    def on_forward_end(self, loss: torch.Tensor) -> torch.Tensor:
        """The strategy's forward computed `loss`, the tensor it is about to
        back-propagate: the observers are told; returns what to back-propagate instead
        (`watch_backward`)."""
        for hook in self._hooks["on_forward_end"]:
            hook()
        return self.watch_backward(loss)

    def watch_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` (about to be back-propagated) as a view of it whose backward is watched
        (`watch_output`): the view's node is the first autograd runs, before any hook on
        `loss` itself (FSDP's on a model's output that is its own loss), so the callback it
        queues runs before the ones they queue. `loss` itself where no one watches."""
        if not (self._hooks["on_grad_ready"] and loss.requires_grad):
            return loss
        root = loss.view_as(loss)
        self.watch_output(root)
        return root

    def watch_output(self, output: torch.Tensor) -> None:
        """Fire ``on_grad_ready`` once the next backward through `output` (a tensor with
        a node in autograd's graph: a loss's view, a pipeline stage's output) has computed
        every gradient: a pre-hook on its node, called as that backward reaches it, queues a
        callback autograd runs once its pass is done, before the callbacks DDP's reducer and
        FSDP queue later to wait for their gradient exchange."""
        if self._hooks["on_grad_ready"] and output.grad_fn is not None:
            output.grad_fn.register_prehook(self._backward_started)

    def _backward_started(self, _: Any) -> None:
        Variable._execution_engine.queue_callback(self._grad_ready)

    def _grad_ready(self) -> None:
        for hook in self._hooks["on_grad_ready"]:
            hook()

    def on_collective_start(self) -> None:
        for hook in self._hooks["on_collective_start"]:
            hook()

    def on_collective_end(self) -> None:
        for hook in self._hooks["on_collective_end"]:
            hook()

    def on_micro_end(self) -> None:
        for hook in self._hooks["on_micro_end"]:
            hook()

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        for hook in self._hooks["on_gradients"]:
            hook(step, loss)

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        for hook in self._hooks["on_grad_norm"]:
            hook(norm)

    def _optimizer_start(self, *_: Any) -> None:
        self._optimizing = True
        for hook in self._hooks["on_optimizer_start"]:
            hook()

    def on_optimizer_step(self, step: int) -> None:
        """An optimizer step made step `step`: `on_optimizer_end`, then `on_loop_step`
        unless it is `train_step`'s own. A step fp16-mixed skipped never ran the
        optimizer's hooks: its `on_optimizer_start` comes here, so that the two pair."""
        if not self._optimizing:
            self._optimizer_start()
        self._optimizing = False
        for hook in self._hooks["on_optimizer_end"]:
            hook(step)
        if self._in_step:
            return
        for hook in self._hooks["on_loop_step"]:
            hook(step)

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        self._in_step = False
        for hook in self._hooks["on_step_end"]:
            hook(step, loss)

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        for hook in self._hooks["on_backward_start"]:
            hook(step, loss)

    def on_backward_end(self) -> None:
        """A hand-written loop's backward returned: from now on each call of the model
        fires `on_forward_start` first (prepended to the model's own hooks, so that the
        gathering of sharded parameters comes after it)."""
        if self._forwards is None and self._model is not None:
            self._forwards = self._model.register_forward_pre_hook(
                self._forward_start, with_kwargs=True, prepend=True
            )
        for hook in self._hooks["on_backward_end"]:
            hook()

    def _forward_start(self, _: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for hook in self._hooks["on_forward_start"]:
            hook((args, kwargs))

    def on_resume(self, step: int) -> None:
        for hook in self._hooks["on_resume"]:
            hook(step)

    def on_close(self, end: End) -> None:
        for hook in self._hooks["on_close"]:
            hook(end)
