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
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from dtrain.plan.engine_probe import lower_quartile, time_engine_step, time_loading
from dtrain.plan.source import Source, Workload
from dtrain.plan.weigh import ModelFigures, sync, weigh
from dtrain.tasks import make_optimizer


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

    @property
    def compute(self) -> float:
        """Forward + backward."""
        return self.forward + self.backward

    @property
    def jitter(self) -> float:
        """The share of time the machine's jitter adds to a step: the mean measured step
        over the lower-quartile step the other terms use, less 1."""
        low = self.forward + self.backward + self.optimizer
        if not self.totals or low <= 0:
            return 0.0
        return max(0.0, sum(self.totals) / len(self.totals) / low - 1)


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
    work: Workload, model: nn.Module, batch: int, device: torch.device, seconds: float
) -> StepTime:
    """Median forward, backward and optimizer seconds of `model` at `batch` samples."""
    inputs, targets = work.batch(batch, device)
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    forwards: list[float] = []
    backwards: list[float] = []
    updates: list[float] = []
    spent, rounds = 0.0, 0
    while rounds < 5 or (spent < seconds and rounds < 50):
        sync(device)
        t0 = time.perf_counter()
        loss = work.loss_fn(model(inputs), targets)
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        rounds += 1
        if rounds > 2:  # two warm-up rounds
            forwards.append(t1 - t0)
            backwards.append(t2 - t1)
            updates.append(t3 - t2)
            spent += t3 - t0
    totals = tuple(sorted(f + b + u for f, b, u in zip(forwards, backwards, updates, strict=True)))
    return StepTime(
        lower_quartile(forwards),
        lower_quartile(backwards),
        lower_quartile(updates),
        time_loading(work, batch, seconds),
        totals,
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
    helper processes train the same model beside this one (`dtrain.plan.busy`), as the
    other ranks of the job would: on the CPU they share the cores' memory and caches.
    The `wrappers` (ddp, zero2, zero3, tensor) are timed then too, at the middle shared
    batch, on a one-rank group.
    """
    from dtrain.plan.overheads import measure_overheads

    began = time.perf_counter()
    shared = sorted(p for p in points if p[2])
    helpers = _start_helpers(source, shared, contenders)  # they build while we weigh
    try:
        model = copy.deepcopy(work.model).to(device)
        figures = weigh(work, model, device, max(p[0] for p in points))
        calibration = Calibration(_describe(device), figures)
        # The helpers' start (importing torch, building the model) would disturb the
        # one-process points and the Engine probe: they wait for it, idle.
        _wait_ready(helpers)
        for point in sorted(p for p in points if not p[2]):
            with _threads(point[1]):
                calibration.steps[point] = time_step(work, model, point[0], device, seconds)
        calibration.engine_seconds = _engine_seconds(work, calibration, device, seconds)
        _go(helpers)
        for point in shared:
            with _threads(point[1]):
                calibration.steps[point] = time_step(work, model, point[0], device, seconds)
        if shared and wrappers:
            batch, threads, _ = shared[len(shared) // 2]
            with _threads(threads):
                calibration.overheads = measure_overheads(
                    work, device, batch, seconds, set(wrappers)
                )
    finally:
        _stop(helpers)
    calibration.copy_bandwidth = copy_bandwidth(figures.param_bytes, device)
    calibration.probe_seconds = time.perf_counter() - began
    return calibration


def _engine_seconds(
    work: Workload, calibration: Calibration, device: torch.device, seconds: float
) -> float:
    """The Engine's own seconds per step: a real one-process Engine's mean step at the
    largest one-process batch probed, less that batch's loading and mean bare step."""
    alone = [p for p in calibration.steps if not p[2]]
    if not alone:
        return 0.0
    batch, threads, _ = max(alone)
    bare = calibration.steps[(batch, threads, False)]
    with _threads(threads):
        whole = time_engine_step(work, batch, device, seconds)
    mean_bare = (
        sum(bare.totals) / len(bare.totals) if bare.totals else bare.compute + bare.optimizer
    )
    return max(0.0, whole - bare.data - mean_bare)


def _start_helpers(
    source: Source, shared: list[tuple[int, int, bool]], count: int
) -> list[subprocess.Popen[str]]:
    if not shared or count < 1:
        return []
    batch, threads, _ = shared[len(shared) // 2]
    command = [sys.executable, "-m", "dtrain.plan.busy", str(batch), str(threads), *source.args()]
    return [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]


def _wait_ready(helpers: list[subprocess.Popen[str]]) -> None:
    """Wait until every helper has built its model (and is idle, waiting for `_go`)."""
    for helper in helpers:
        assert helper.stdout is not None
        if helper.stdout.readline().strip() != "ready":
            raise RuntimeError("a compute-probe helper process failed to start")


def _go(helpers: list[subprocess.Popen[str]]) -> None:
    """Let every helper train."""
    for helper in helpers:
        assert helper.stdin is not None
        helper.stdin.write("go\n")
        helper.stdin.flush()


def _stop(helpers: list[subprocess.Popen[str]]) -> None:
    for helper in helpers:
        assert helper.stdin is not None
        helper.stdin.close()
    for helper in helpers:
        try:
            helper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()


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
