"""Shared by the benchmarks: launch workers, time steps, alternate dtrain and its peer.

The peer is the plain-PyTorch loop a user would write by hand. Both run in the same
processes, alternating which goes first, so drifts of a noisy machine hit both; the
figure to read is the median of the per-repeat ratios dtrain / peer.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

R = TypeVar("R")


def arguments(
    doc: str, batch: int, steps: int, warmup: int, repeats: int | None
) -> argparse.ArgumentParser:
    """A parser with the flags every benchmark shares (and --repeats unless None)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=batch)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return parser


def launch(nproc: int, worker: Callable[..., Any], *args: Any) -> list[Any]:
    """Run worker(*args) on `nproc` local processes; return the results by rank."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=uuid.uuid4().hex,
        max_restarts=0,
        start_method="spawn",
    )
    results = elastic_launch(config, worker)(*args)
    return [results[rank] for rank in sorted(results)]


def timed(batches: Iterable[Any], step: Callable[[Any], Any], warmup: int, steps: int) -> float:
    """Seconds for `steps` calls of step(batch) after `warmup` untimed ones (all ranks)."""
    return timed_with_cpu(batches, step, warmup, steps)[0]


def timed_with_cpu(
    batches: Iterable[Any], step: Callable[[Any], Any], warmup: int, steps: int
) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, all its threads) for `steps` calls of
    step(batch) after `warmup` untimed ones (all ranks). CPU time counts the work a loop
    does and not the time it waited for a core, so on a machine other jobs share it tells
    apart two loops that wall time cannot."""
    it = iter(batches)
    for _ in range(warmup):
        step(next(it))
    _settle()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step(next(it))
    _settle()
    return time.perf_counter() - start, time.process_time() - cpu


def per_step(
    batches: Iterable[Any],
    step: Callable[[Any], Any],
    warmup: int,
    steps: int,
    windows: int = 10,
    settle: bool = True,
) -> float:
    """Seconds per step: the median over `windows` equal windows of the `steps` calls of
    step(batch) after `warmup` untimed ones, so that a window another job's burst slowed
    does not move the figure. `settle`: wait for every rank before the first window and
    after the last (False where the default group holds processes that do not step, such
    as parameter servers)."""
    it = iter(batches)
    for _ in range(warmup):
        step(next(it))
    if settle:
        _settle()
    size = max(1, steps // windows)
    times = []
    for _ in range(max(1, steps // size)):
        start = time.perf_counter()
        for _ in range(size):
            step(next(it))
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / size)
    if settle:
        _settle()
    return statistics.median(times)


@dataclass
class Loop:
    """A training loop ready to run: its batches and its step."""

    batches: Iterator[Any]
    step: Callable[[Any], Any]


def interleaved(
    peer: Loop, ours: Loop, warmup: int, steps: int, windows: int = 10
) -> tuple[float, float]:
    """(peer, ours) seconds per step, measured side by side in this process (and in step
    on every rank): each loop warms up with `warmup` untimed steps, then they take turns,
    `windows` windows of steps // windows steps each, the loop that goes first alternating;
    each figure is the median of its windows. A burst of another job's work then slows a
    window of one loop or the other and is left out of both medians, and a drift of the
    machine's pace over the run hits both alike."""
    for loop in (peer, ours):
        for _ in range(warmup):
            loop.step(next(loop.batches))
    _settle()
    windows = max(1, min(windows, steps))
    size = steps // windows
    times: tuple[list[float], list[float]] = ([], [])
    for window in range(windows):
        turns = ((0, peer), (1, ours)) if window % 2 == 0 else ((1, ours), (0, peer))
        for slot, loop in turns:
            start = time.perf_counter()
            for _ in range(size):
                loop.step(next(loop.batches))
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            times[slot].append((time.perf_counter() - start) / size)
    _settle()
    return statistics.median(times[0]), statistics.median(times[1])


def pipeline_step(schedule: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One step of a `torch.distributed.pipelining` schedule with one stage per rank: the
    first rank feeds the inputs, the last the targets (its losses kept)."""
    x, y = batch
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()


def _settle() -> None:
    """Wait for every rank, and on a GPU for the work queued on it, before a clock read."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()


def alternate(repeats: int, peer: Callable[[], R], ours: Callable[[], R]) -> list[tuple[R, R]]:
    """(peer, ours) results of `repeats` rounds, the first runner alternating each round."""
    pairs = []
    for repeat in range(repeats):
        if repeat % 2 == 0:
            a = peer()
            b = ours()
        else:
            b = ours()
            a = peer()
        pairs.append((a, b))
    return pairs


def report(title: str, pairs: list[tuple[float, float]], unit: str = "samples/s") -> float:
    """Print each repeat and the medians; return the median ratio ours / peer."""
    print(title)
    print(f"{'repeat':>6} {'peer ' + unit:>18} {'dtrain ' + unit:>18} {'ratio':>7}")
    for i, (peer, ours) in enumerate(pairs):
        print(f"{i:>6} {peer:>18,.1f} {ours:>18,.1f} {ours / peer:>7.3f}")
    ratios = [ours / peer for peer, ours in pairs]
    ratio = statistics.median(ratios)
    print(
        f"median peer {statistics.median(p for p, _ in pairs):,.1f} {unit}, median dtrain "
        f"{statistics.median(o for _, o in pairs):,.1f} {unit}, median ratio {ratio:.3f} "
        f"(spread {min(ratios):.3f} - {max(ratios):.3f})\n"
    )
    return ratio
