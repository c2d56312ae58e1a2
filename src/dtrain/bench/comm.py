"""`dtrain bench comm`: how fast the collectives run on these processes and links.

For each collective and message size (doubling from `--min-bytes` to `--max-bytes`), every
rank runs a few warm-up calls, then timed calls between barriers; the time of a size is
the slowest rank's median. Bandwidths follow the nccl-tests definitions: the algorithm
bandwidth is S / t for a message of S bytes; the bus bandwidth scales it by what each
rank must move in the best algorithm, so that it compares with the link's speed whatever
the number of ranks n:

- all_reduce: 2(n-1)/n (a ring's reduce-scatter then all-gather),
- reduce_scatter, all_gather: (n-1)/n (S is the whole, unscattered tensor),
- broadcast, send_recv: 1 (send/recv between ranks 0 and 1, the others idle).

Run as a dtrain script: ``dtrain bench comm --nproc N`` launches it on N processes.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import dtrain
from dtrain.bench.comm_flags import OPS, add_args
from dtrain.errors import ConfigError
from dtrain.observe.metrics import format_table

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}
"""Bytes each rank moves per byte of message, in the bandwidth-optimal algorithm."""
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text: str) -> int:
    """``"1K"``, ``"256M"``, ``"4096"`` -> bytes."""
    value = text.strip().upper().removesuffix("B")
    unit = value[-1:] if value[-1:] in UNITS else ""
    try:
        return int(float(value.removesuffix(unit)) * UNITS[unit])
    except ValueError:
        raise ConfigError(f"Expected a size such as 1K, 64M or 4096, got {text!r}.") from None


def sizes(low: int, high: int, ranks: int) -> list[int]:
    """Message sizes from `low` to `high` bytes, doubling, each a multiple of 4 x `ranks`
    (whole fp32 elements, split evenly by reduce_scatter and all_gather)."""
    if low < 1 or high < low:
        raise ConfigError(
            f"--min-bytes must be at least 1 and at most --max-bytes; got {low} and {high}."
        )
    step = 4 * ranks
    out, size = [], low
    while size <= high:
        out.append(max(step, size // step * step))
        size *= 2
    return sorted(set(out))


def check_ops(text: str) -> list[str]:
    """The collectives named in `text`, or a ConfigError listing the known ones."""
    ops = [op.strip() for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ConfigError(
            f"Unknown collective(s) {', '.join(unknown) or '(none)'} for --ops; choose from "
            f"{', '.join(OPS)}."
        )
    return ops


def _call(op: str, tensor: torch.Tensor, out: torch.Tensor, rank: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(tensor)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(out, tensor)
    elif op == "all_gather":
        dist.all_gather_single(tensor, out)
    elif op == "broadcast":
        dist.broadcast(tensor, src=0)
    elif rank == 0:
        dist.send(tensor, dst=1)
    elif rank == 1:
        dist.recv(tensor, src=0)


def _median_seconds(
    op: str, size: int, iters: int, warmup: int, device: torch.device, rank: int, world: int
) -> float:
    """The slowest rank's median seconds per call of `op` on `size` bytes."""
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
    out = torch.empty(size // 4 // world, dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _call(op, tensor, out, rank)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            _call(op, tensor, out, rank)
            seconds = time.perf_counter() - began
        if i >= warmup:
            times.append(seconds)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    """Measure every op at every size on the launched processes; the main rank prints the
    table (and writes --csv / --json). Returns the rows."""
    parser = argparse.ArgumentParser(prog="dtrain bench comm")
    add_args(parser)
    args, _ = parser.parse_known_args(argv)
    ops = check_ops(args.ops)
    engine = dtrain.init()
    world = engine.world_size
    if world < 2:
        raise ConfigError(
            "dtrain bench comm measures collectives between processes; give --nproc 2 or more."
        )
    device = engine.topology.device
    rows: list[dict[str, object]] = []
    for op in ops:
        for size in sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), world):
            iters = args.iters if size <= 16 * 2**20 else max(3, args.iters // 4)
            seconds = _median_seconds(op, size, iters, args.warmup, device, engine.rank, world)
            algbw = size / seconds / 1e9
            rows.append(
                {
                    "op": op,
                    "bytes": size,
                    "ranks": world,
                    "microseconds": seconds * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * BUS_FACTOR[op](world),
                }
            )
    if engine.is_main:
        _report(rows, args.csv, args.json)
    engine.close()
    return rows


def _report(rows: list[dict[str, object]], to_csv: Path | None, to_json: Path | None) -> None:
    lines = [f"{'op':<15}{'bytes':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for row in rows:
        lines.append(
            f"{row['op']:<15}{row['bytes']:>12}{row['microseconds']:>12.1f}"
            f"{row['algbw_GBps']:>12.3f}{row['busbw_GBps']:>12.3f}"
        )
    print("\n".join(lines), flush=True)
    peak = max(rows, key=lambda r: float(r["busbw_GBps"]))  # type: ignore[arg-type]
    print(
        format_table(
            [
                ("ranks", peak["ranks"]),
                ("peak bus bandwidth (GB/s)", peak["busbw_GBps"]),
                ("at", f"{peak['op']} of {peak['bytes']} bytes"),
            ]
        ),
        flush=True,
    )
    if to_csv:
        to_csv.parent.mkdir(parents=True, exist_ok=True)
        with to_csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if to_json:
        to_json.parent.mkdir(parents=True, exist_ok=True)
        to_json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
