"""Where each step's time goes, measured on every rank, always on.

A step is the time from one `train_step` to the next. It is cut into:

- ``data``: waiting for the loader's next batch (host time);
- ``forward``: the model's forward and the loss;
- ``backward``: backward up to the moment autograd has computed every gradient (a
  callback autograd runs at the end of its pass marks it, queued by a hook on the loss:
  one mark per backward, however many parameters);
- ``communication``: what backward still waited for after that, the gradient
  synchronisation compute did not hide (DDP's last buckets, a straggler's lateness), plus
  the optimizer step of strategies whose step is the exchange itself (parameter servers),
  plus the collectives the forward and backward themselves wait for (context
  parallelism's gathers of keys and values: taken out of forward and backward);
- ``optimizer``: clipping and the optimizer step;
- ``other``: the rest (the user's loop between steps, logging, checkpoints).

Marks come from `dtrain.observe.clock` (CUDA events on a GPU), so nothing here makes the
host wait for the device; marks are turned into seconds when the Engine reads the loss
back anyway. A hand-written loop (its own forward, `engine.backward` and
``optimizer.step()``) has steps from one optimizer step to the next, cut alike: its forward
runs from the call of the model to `engine.backward` (see `RunTiming.on_forward_start`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dtrain.observe.clock import HostClock, Mark

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other", "step")
"""The keys of one rank's breakdown, seconds per step (the metrics JSON's contract)."""

KEPT_STEPS = 10_000
"""Steps whose times are kept for the medians (the most recent ones)."""

TIMED_FIRST = 20
"""Every one of a timer's first steps is timed (a short run still has its breakdown)."""

ENOUGH_SAMPLED = 20
"""Sampled steps (after warm-up) from which on the medians take only them: the first steps,
often slower, then weigh no more than their share of the run."""

TIMED_SHARE = 0.25
"""The share of the later steps that are timed: the breakdown is made of medians, which a
sample estimates as well as every step would, and a step that is not timed costs the
host nothing but the check (on a GPU, no CUDA event recorded)."""

_GOLDEN = (5**0.5 - 1) / 2
"""Step n is timed when frac(n x this) < TIMED_SHARE: a quarter of the steps, spread
evenly with no period (so no rhythm of the loop, such as a loss read every 10 steps or a
checkpoint every 100, is over- or under-represented), the same steps on every rank."""

Span = tuple[str, int, float, float]
"""(phase, optimizer step, start, duration), seconds on the aligned clock."""


@dataclass
class _Micro:
    """Marks of one micro-batch: begin, forward done, last gradient ready, backward done."""

    begin: Mark
    forward: Mark | None = None
    grad: Mark | None = None
    end: Mark | None = None
    collectives: list[list[Mark | None]] = field(default_factory=list)
    """[start, end] of each collective inside its forward or backward."""


@dataclass
class _Step:
    """The marks of one step until they are resolved into seconds."""

    number: int
    start: Mark
    micros: list[_Micro] = field(default_factory=list)
    optimizer: list[Mark] = field(default_factory=list)
    data: tuple[float, float] | None = None
    """Host seconds (since the origin) of the wait for the next step's batch."""
    end: Mark | None = None
    """The start of the step after it."""


def warmup_steps(count: int) -> int:
    """Steps left out of the medians at the start: the first ones build caches, buckets
    and allocator pools."""
    return 3 if count > 6 else 1 if count > 2 else 0


class StepTimer:
    """The marks of the running step and the seconds of the finished ones: every one of
    the first TIMED_FIRST steps, then a TIMED_SHARE of the steps (and every step of the
    trace window).

    Args:
        clock: where marks come from.
        exchange_in_step: True where the optimizer step is the gradient exchange (the
            parameter servers' push/pull): it counts as communication.
        trace_window: keep spans of optimizer steps A to B-1 for the trace, or None.
    """

    def __init__(
        self,
        clock: HostClock,
        exchange_in_step: bool = False,
        trace_window: tuple[int, int] | None = None,
    ) -> None:
        self.clock = clock
        self.exchange_in_step = exchange_in_step
        self.trace_window = trace_window
        self.times: dict[str, deque[float]] = {p: deque(maxlen=KEPT_STEPS) for p in PHASES}
        """Seconds of each finished step, by phase (``other`` is per step too)."""
        self.spans: list[Span] = []
        """Spans of the traced steps."""
        self._running: _Step | None = None
        """The step running now, if it is timed."""
        self._done: list[_Step] = []
        """Timed steps that ended, not yet resolved."""
        self._begun = 0
        """Steps begun."""
        self._micro: _Micro | None = None
        """The timed micro-batch running now."""
        self._in_micro = False
        """A micro-batch runs now (timed or not)."""
        self._sampled: deque[bool] = deque(maxlen=KEPT_STEPS)
        """Whether each step in `times` was sampled (timed for the sample, not for being
        among the first or traced)."""

    # -- marks (the hot path: no host synchronisation) ----------------------------------
    def grad_ready(self) -> None:
        """A backward of the micro-batch computed its gradients: its "last gradient
        ready" mark (recorded again by a later backward of the same micro-batch, such as a
        pipeline's next chunk: the last record wins)."""
        micro = self._micro
        if micro is not None:
            micro.grad = self.clock.mark(micro.grad)

    def begin_step(self, number: int) -> None:
        """Step `number` (1-based) starts now; the step before it ends here."""
        self._begun += 1
        self._micro = None  # a forward whose backward never came ends with its step
        self._in_micro = False
        running, timed = self._running, self._timed(number)
        if running is None and not timed:
            return
        now = self.clock.mark()
        if running is not None:
            running.end = now
            self._done.append(running)
        self._running = _Step(number, now) if timed else None

    def _timed(self, number: int) -> bool:
        """Whether step `number` is timed."""
        return self._begun <= TIMED_FIRST or self._traced(number) or _sampled(number)

    def _traced(self, number: int) -> bool:
        window = self.trace_window
        return window is not None and window[0] <= number - 1 < window[1]

    @property
    def in_micro(self) -> bool:
        """True between a micro-batch's begin and its end (timed or not)."""
        return self._in_micro

    def begin_micro(self) -> None:
        """A micro-batch's forward starts now."""
        self._in_micro = True
        if self._running is not None:
            self._micro = _Micro(self.clock.mark())
            self._running.micros.append(self._micro)

    def forward_done(self) -> None:
        """The micro-batch's loss is computed; backward starts."""
        if self._micro is not None:
            self._micro.forward = self.clock.mark()

    def end_micro(self) -> None:
        """The micro-batch's backward (with its gradient synchronisation) returned."""
        self._in_micro = False
        if self._micro is not None:
            self._micro.end = self.clock.mark()
            self._micro = None

    def collective_begin(self) -> None:
        """A collective inside the micro-batch's forward or backward starts now."""
        if self._micro is not None:
            self._micro.collectives.append([self.clock.mark(), None])

    def collective_end(self) -> None:
        """The collective begun last returned."""
        if self._micro is not None and self._micro.collectives:
            self._micro.collectives[-1][1] = self.clock.mark()

    def optimizer_mark(self) -> None:
        """The optimizer phase starts (first call of a step) or ends (second call)."""
        if self._running is not None:
            self._running.optimizer.append(self.clock.mark())

    def data_wait(self, start: float, end: float) -> None:
        """The loop waited from host time `start` to `end` (``time.perf_counter``) for the
        next batch: counted in the step now running, which that wait delays."""
        if self._running is not None:
            origin = self.clock.origin
            self._running.data = (start - origin, end - origin)

    # -- resolving, where the host waits anyway ------------------------------------------
    def collect(self, final: bool = False) -> None:
        """Turn every finished step's marks into seconds; with `final`, end the running
        step now too (at the end of the run)."""
        if final:
            last, self._running = self._running, None
            # After a hand-written loop's last optimizer step: no step's work, no step.
            if last is not None and (last.micros or last.optimizer):
                last.end = self.clock.mark()
                self._done.append(last)
        done, self._done = self._done, []
        if not done:
            return
        read = self.clock.reader(done[-1].end)  # every mark of `done` came before it

        def at(mark: Mark | None) -> float | None:
            return None if mark is None else read(mark)

        for step in done:
            self._resolve(step, read(step.start), read(step.end), at)

    def _resolve(
        self, step: _Step, start: float, end: float, at: Callable[[Mark | None], float | None]
    ) -> None:
        forward = backward = communication = optimizer = data = 0.0
        traced = self._traced(step.number)
        spans: list[tuple[str, float, float]] = []  # kept for the trace only
        inner: list[tuple[str, float, float]] = []  # collectives inside forward / backward
        for m in step.micros:
            begin, stop = at(m.begin), at(m.end)
            if begin is None or stop is None:
                continue
            fwd, grad = at(m.forward), at(m.grad)
            fwd = begin if fwd is None else fwd
            ready = stop if grad is None else min(max(grad, fwd), stop)
            forward += max(0.0, fwd - begin)
            backward += max(0.0, ready - fwd)
            communication += max(0.0, stop - ready)
            if traced:
                spans += [("forward", begin, fwd), ("backward", fwd, ready)]
                spans.append(("communication", ready, stop))
            for a, b in ((at(c[0]), at(c[1])) for c in m.collectives):
                if a is not None and b is not None:
                    inner.append(("forward" if a < fwd else "backward", a, b))
        if len(step.optimizer) >= 2:
            o0, o1 = at(step.optimizer[0]), at(step.optimizer[-1])
            assert o0 is not None and o1 is not None
            if self.exchange_in_step:
                communication += max(0.0, o1 - o0)
            else:
                optimizer += max(0.0, o1 - o0)
            if traced:
                name = "communication" if self.exchange_in_step else "optimizer"
                spans.append((name, o0, o1))
        if step.data is not None:
            data = max(0.0, step.data[1] - step.data[0])
            if traced:
                spans.append(("data", *step.data))
        for name, a, b in inner:
            taken = forward if name == "forward" else backward
            moved = min(max(0.0, b - a), taken)
            if name == "forward":
                forward -= moved
            else:
                backward -= moved
            communication += moved
        parts = (data, forward, backward, communication, optimizer)
        total = end - start
        times = self.times
        for name, seconds in zip(PHASES[:5], parts, strict=True):
            times[name].append(seconds)
        times["other"].append(max(0.0, total - sum(parts)))
        times["step"].append(total)
        self._sampled.append(_sampled(step.number))
        if traced:
            spans += [("communication", a, b) for _, a, b in inner]
            self.spans += [(n, step.number, a, b - a) for n, a, b in spans if b > a]

    def medians(self) -> dict[str, float] | None:
        """Seconds per step by phase: medians over the timed steps after warm-up (only the
        sampled ones once there are ENOUGH_SAMPLED of them), with ``other`` what the
        step's median leaves after the parts (so they add up); None before two steps have
        finished."""
        count = len(self.times["step"])
        if count < 2:
            return None
        kept = range(warmup_steps(count), count)
        sampled = [i for i in kept if self._sampled[i]]
        rows = sampled if len(sampled) >= ENOUGH_SAMPLED else kept
        median = {}
        for p in PHASES:
            times = list(self.times[p])
            median[p] = statistics.median(times[i] for i in rows)
        median["other"] = max(0.0, median["step"] - sum(median[p] for p in PHASES[:5]))
        return median


def _sampled(number: int) -> bool:
    """Whether step `number` is one of the TIMED_SHARE the breakdown samples."""
    return (number * _GOLDEN) % 1.0 < TIMED_SHARE
