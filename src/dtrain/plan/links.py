"""The links between processes: seconds per collective by message size, measured.

The probe is `dtrain bench comm` itself (all_reduce, reduce_scatter, all_gather,
broadcast and send/recv, from 4 KiB to 16 MiB, a few timed calls per size) run on
``--nproc`` processes in a child `dtrain` command; its JSON rows become a table of
seconds by (collective, size), made non-decreasing in the size where noise broke that
(`monotone_fit`). A time between two measured sizes is interpolated
log-linearly; below the smallest it is the smallest's (latency bound), above the largest
it grows in proportion to the size (bandwidth bound). Where the user gives a bandwidth
and a latency instead (``--link-gbps``, ``--link-latency-us``), every collective costs
latency + bus bytes / bandwidth (the nccl-tests bus factors).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.errors import ConfigError

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv")
PROBE_ARGS = ("--min-bytes", "4K", "--max-bytes", "16M", "--iters", "11", "--warmup", "2")


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank moves per byte of message (nccl-tests): 2(n-1)/n for all_reduce,
    (n-1)/n for reduce_scatter and all_gather, 1 for broadcast and send/recv."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


@dataclass
class Links:
    """Seconds per collective over `ranks` processes of one machine."""

    ranks: int
    measured: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """op -> [(bytes, seconds)] sorted by size (from the probe)."""
    bandwidth: float | None = None
    """Bus bandwidth in bytes/s, when given instead of measured."""
    latency: float = 0.0
    """Seconds per call, when given instead of measured."""
    source: str = "measured"

    def seconds(self, op: str, size: float, ranks: int | None = None) -> float:
        """One `op` on a message of `size` bytes (the whole tensor) over `ranks` (default:
        the probed ranks; other counts scale the bus bytes by the bus factor)."""
        n = ranks or self.ranks
        if n <= 1 and op != "send_recv":
            return 0.0
        if self.bandwidth is not None:
            return self.latency + bus_factor(op, n) * size / self.bandwidth
        base = _interpolate(self.measured[op], size * _rescale(op, n, self.ranks))
        return base

    @property
    def latency_seconds(self) -> float:
        """A small all_reduce's time (the smallest size probed)."""
        if self.bandwidth is not None:
            return self.latency
        return self.measured["all_reduce"][0][1]

    @property
    def bus_bandwidth(self) -> float:
        """all_reduce bus bandwidth at the largest size probed, bytes/s."""
        if self.bandwidth is not None:
            return self.bandwidth
        size, seconds = self.measured["all_reduce"][-1]
        return bus_factor("all_reduce", self.ranks) * size / seconds

    @property
    def p2p_bandwidth(self) -> float:
        """send/recv bandwidth at the largest size probed, bytes/s."""
        if self.bandwidth is not None:
            return self.bandwidth
        size, seconds = self.measured["send_recv"][-1]
        return size / seconds


def _rescale(op: str, n: int, probed: int) -> float:
    """Message-size factor that gives `n` ranks the bus bytes measured at `probed` ranks."""
    if n == probed or probed <= 1:
        return 1.0
    return bus_factor(op, n) / bus_factor(op, probed)


def _interpolate(points: list[tuple[int, float]], size: float) -> float:
    if size <= points[0][0]:
        return points[0][1]
    if size >= points[-1][0]:
        last_size, last = points[-1]
        return last * size / last_size
    for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False):
        if s0 <= size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return points[-1][1]


def given(ranks: int, gbps: float, latency_us: float) -> Links:
    """Links of `gbps` gigabytes per second of bus bandwidth and `latency_us` per call."""
    if gbps <= 0 or latency_us < 0:
        raise ConfigError(
            f"--link-gbps must be positive and --link-latency-us at least 0, got {gbps} and "
            f"{latency_us}."
        )
    return Links(ranks, bandwidth=gbps * 1e9, latency=latency_us * 1e-6, source="given")


def probe(ranks: int, cpu: bool) -> Links:
    """Run `dtrain bench comm` on `ranks` processes and read its table."""
    with tempfile.TemporaryDirectory(prefix="dtrain-plan-") as tmp:
        out = Path(tmp) / "comm.json"
        command = [
            sys.executable, "-m", "dtrain.cli", "bench", "comm", "--nproc", str(ranks),
            "--ops", ",".join(OPS), *PROBE_ARGS, "--json", str(out),
        ]  # fmt: skip
        if cpu:
            command.append("--cpu")
        env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0 or not out.exists():
            raise ConfigError(
                f"The link probe (dtrain bench comm --nproc {ranks}) failed:\n"
                f"{done.stderr.strip()[-1500:]}\nGive the link's figures instead with "
                "--link-gbps and --link-latency-us."
            )
        rows = json.loads(out.read_text())
    measured: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        measured.setdefault(row["op"], []).append(
            (int(row["bytes"]), float(row["microseconds"]) * 1e-6)
        )
    return Links(ranks, {op: monotone_fit(points) for op, points in measured.items()})


def monotone_fit(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The (bytes, seconds) points sorted by size, with the times replaced by their
    isotonic regression (pool adjacent violators): a collective never takes less time for
    more bytes, so where a size measured slower than a larger one, both are noisy
    samples of one time and get their mean. Unlike a lower envelope, this keeps the
    typical cost of a call on this machine (the runs pay the same interruptions)."""
    ordered = sorted(points)
    blocks: list[list[float]] = []  # [sum of times, count]
    for _, seconds in ordered:
        blocks.append([seconds, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    times = [total / count for total, count in blocks for _ in range(int(count))]
    return [(size, t) for (size, _), t in zip(ordered, times, strict=True)]
