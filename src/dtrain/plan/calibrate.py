"""Calibration by measurement: how fast the device trains the model, and what it weighs.

A few seconds on the actual device, in this process:

- the compute probe: forward + loss + backward, and the optimizer step, timed at each
  per-device batch and thread count the candidate layouts need (the lower quartile of
  repeats after a warm-up; their spread is the machine's jitter), so the small-batch
  inefficiency of a split batch is measured rather than assumed;
- loading a batch from the data set, and the Engine's own work per step
  (`dtrain.plan.engine_probe`);
- the model's bytes, FLOPs and per-layer shares (`dtrain.plan.weigh`);
- the torch wrappers' own cost (`dtrain.plan.overheads`).

On the CPU, every process of a multi-process layout runs cores / processes threads (the
launcher's rule), so the probe times each layout's batch at that thread count.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from dtrain.models.recipes import make_optimizer
from dtrain.plan.engine_probe import (
    endless_batches,
    lower_quartile,
    time_engine_step,
    time_loading,
)
from dtrain.plan.lockstep import LEAVE, Helpers, Lockstep
from dtrain.plan.source import Source, Workload
from dtrain.plan.weigh import ModelFigures, sync, weigh


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step's parts at one batch and thread count."""

    forward: float
    backward: float
    optimizer: float
    data: float = 0.0
    """Loading the batch with the loader `engine.dataloader` builds (`engine_probe`)."""
    totals: tuple[float, ...] = ()
    """Every timed step's forward + backward + optimizer, sorted (their spread is the
    machine's jitter: other jobs, the scheduler)."""
    sync: float = 0.0
    """One synchronization with the other ranks in lockstep: a one-element all-reduce at
    the end of each step (`dtrain.plan.lockstep`); 0 where no other rank was probed."""

    @property
    def compute(self) -> float:
        """Forward + backward."""
        return self.forward + self.backward


@dataclass
class Calibration:
    """The device's measured rates for one model."""

    device: str
    figures: ModelFigures
    steps: dict[tuple[int, int, bool], StepTime] = field(default_factory=dict)
    """(per-device batch, threads, beside other ranks) -> measured step parts."""
    copy_bandwidth: float = 0.0
    """Bytes per second of a copy of the parameters on the device (towers' replicas)."""
    overheads: dict[str, float] = field(default_factory=dict)
    """Seconds per step each torch wrapper adds by itself (`dtrain.plan.overheads`)."""
    engine_seconds: float = 0.0
    """Seconds per step the Engine's own work adds on every rank (`engine_probe`)."""
    probe_seconds: float = 0.0

    @property
    def sync_seconds(self) -> float:
        """One synchronization of the ranks in lockstep (the median over the shared
        points; 0 where none was probed)."""
        syncs = [s.sync for (_, _, shared), s in self.steps.items() if shared and s.sync > 0]
        return statistics.median(syncs) if syncs else 0.0

    def jitter(self, shared: bool) -> float:
        """The share of time the machine's jitter adds to a step, pooled over every point
        probed alone (or `shared`): all their measured steps over as many lower-quartile
        steps, less 1. Pooled, since one point's few rounds (a large model's step takes a
        fifth of a second) let a single pause swing it."""
        spent = low = 0.0
        for (_, _, beside), s in self.steps.items():
            if beside == shared and s.totals:
                spent += sum(s.totals)
                low += len(s.totals) * (s.forward + s.backward + s.optimizer)
        return max(0.0, spent / low - 1) if low > 0 else 0.0

    def step(self, batch: int, threads: int, shared: bool) -> StepTime:
        """The step parts at `batch` and `threads`, alone or `shared` with other ranks
        (measured, or interpolated in the batch between the nearest measured points)."""
        if (batch, threads, shared) in self.steps:
            return self.steps[(batch, threads, shared)]
        points = sorted(
            (b, s) for (b, t, c), s in self.steps.items() if t == threads and c == shared
        )
        if not points:
            raise KeyError(f"no probe at {threads} thread(s)")
        below = [p for p in points if p[0] <= batch][-1:] or points[:1]
        above = [p for p in points if p[0] >= batch][:1] or points[-1:]
        (b0, s0), (b1, s1) = below[0], above[0]
        w = 0.0 if b1 == b0 else (batch - b0) / (b1 - b0)
        return StepTime(
            s0.forward + w * (s1.forward - s0.forward),
            s0.backward + w * (s1.backward - s0.backward),
            s0.optimizer,
            s0.data + w * (s1.data - s0.data),
            s0.totals if w < 0.5 else s1.totals,
            s0.sync + w * (s1.sync - s0.sync),
        )


@contextmanager
def _threads(count: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def time_step(
    work: Workload,
    model: nn.Module,
    batch: int,
    device: torch.device,
    seconds: float,
    lockstep: Lockstep | None = None,
) -> StepTime:
    """Lower-quartile forward, backward and optimizer seconds of `model` at `batch`
    samples. In `lockstep` with helper ranks, each step also loads its batch and ends
    with the group's all-reduce, both timed (alone, the loading is timed on its own)."""
    inputs, targets = work.batch(batch, device)
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    loads = endless_batches(work, batch) if lockstep is not None else None
    parts: list[tuple[float, float, float, float, float]] = []
    spent, rounds = 0.0, 0
    while rounds < 5 or (spent < seconds and rounds < 50):
        sync(device)
        t0 = time.perf_counter()
        if loads is not None:
            next(loads)
        t1 = time.perf_counter()
        loss = work.loss_fn(model(inputs), targets)
        sync(device)
        t2 = time.perf_counter()
        loss.backward()
        sync(device)
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t4 = time.perf_counter()
        if lockstep is not None:
            lockstep.sync(batch)  # the helpers run this batch too
        t5 = time.perf_counter()
        rounds += 1
        if rounds > 2:  # two warm-up rounds
            parts.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))
            spent += t5 - t0
    data, forwards, backwards, updates, syncs = (list(p) for p in zip(*parts, strict=True))
    totals = tuple(sorted(f + b + u for f, b, u in zip(forwards, backwards, updates, strict=True)))
    return StepTime(
        lower_quartile(forwards),
        lower_quartile(backwards),
        lower_quartile(updates),
        lower_quartile(data) if loads is not None else time_loading(work, batch, seconds),
        totals,
        lower_quartile(syncs) if lockstep is not None else 0.0,
    )


def measure(
    work: Workload,
    points: set[tuple[int, int, bool]],
    device: torch.device,
    source: Source,
    contenders: int,
    seconds: float,
    wrappers: set[str] = frozenset(),  # type: ignore[assignment]
) -> Calibration:
    """Time the model at every (per-device batch, threads, shared) of `points`; weigh it.

    The shared points (the ranks of a multi-process layout) are timed while `contenders`
    helper processes train the same model beside this one, in lockstep with it
    (`dtrain.plan.lockstep`), as the other ranks of the job would: on the CPU they share
    the cores' memory and caches and wait for each other every step. The `wrappers`
    (ddp, zero2, zero3, tensor) are timed then too, at the middle shared batch, on a
    one-rank group, while the helpers train on their own.
    """
    from dtrain.plan.overheads import measure_overheads

    began = time.perf_counter()
    shared = sorted(p for p in points if p[2])
    helpers = None
    if shared and contenders > 0:  # they build while we weigh
        batch, threads, _ = shared[len(shared) // 2]
        helpers = Helpers(source, batch, threads, contenders)
    try:
        model = copy.deepcopy(work.model).to(device)
        figures = weigh(work, model, device, max(p[0] for p in points))
        calibration = Calibration(_describe(device), figures)
        # The helpers' start (importing torch, building the model) would disturb the
        # one-process points and the Engine probe: they wait for it, idle.
        if helpers is not None:
            helpers.wait_ready()
        for point in sorted(p for p in points if not p[2]):
            with _threads(point[1]):
                calibration.steps[point] = time_step(work, model, point[0], device, seconds)
        calibration.engine_seconds = _engine_seconds(work, calibration, device, seconds)
        lockstep = helpers.go() if helpers is not None else None
        for point in shared:
            with _threads(point[1]):
                calibration.steps[point] = time_step(
                    work, model, point[0], device, seconds, lockstep
                )
        if lockstep is not None:
            lockstep.sync(LEAVE)  # the helpers train on, on their own
        if shared and wrappers:
            batch, threads, _ = shared[len(shared) // 2]
            with _threads(threads):
                calibration.overheads = measure_overheads(
                    work, device, batch, seconds, set(wrappers)
                )
    finally:
        if helpers is not None:
            helpers.stop()
    calibration.copy_bandwidth = copy_bandwidth(figures.param_bytes, device)
    calibration.probe_seconds = time.perf_counter() - began
    return calibration


def _engine_seconds(
    work: Workload, calibration: Calibration, device: torch.device, seconds: float
) -> float:
    """The Engine's own seconds per step: a real one-process Engine's lower-quartile step
    at the largest one-process batch probed, less that batch's loading and lower-quartile
    bare step."""
    alone = [p for p in calibration.steps if not p[2]]
    if not alone:
        return 0.0
    batch, threads, _ = max(alone)
    bare = calibration.steps[(batch, threads, False)]
    with _threads(threads):
        whole = time_engine_step(work, batch, device, seconds)
    low_bare = lower_quartile(list(bare.totals)) if bare.totals else bare.compute + bare.optimizer
    return max(0.0, whole - bare.data - low_bare)


def copy_bandwidth(size: int, device: torch.device) -> float:
    """Bytes per second of copying `size` bytes on `device` (median of a few copies)."""
    source = torch.empty(max(size, 2**20) // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(7):
        sync(device)
        t0 = time.perf_counter()
        target.copy_(source)
        sync(device)
        times.append(time.perf_counter() - t0)
    return source.numel() * 4 / max(statistics.median(times[2:]), 1e-9)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"cpu ({torch.get_num_threads()} threads)"
