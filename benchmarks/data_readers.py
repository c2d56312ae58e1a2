"""The readers of `engine.dataloader` on a data-bound job, and the diagnosis's advice.

A small MLP trains on samples that take `--decode-ms` each to decode (a sleep, as reading
a file or a network would take; `--busy` makes it a CPU loop instead), read three ways:
a map-style dataset, a stream (an IterableDataset) and shard files (`dtrain.ShardFiles`
of the same samples, written once to a temporary directory). Every reader decodes in the
DataLoader's `collate_fn`, in the reader process, so the three differ only in how they
read. Each reader runs at num_workers 0, 1 and 2, `--repeats` times (the repeat loop
outside, so a noisy machine's drifts hit every reader alike); each run times `--steps`
steps after `--warmup` (the workers' start) and prints samples/s, then the medians and the
ratio of each reader to the map-style loader (goal: shard files >= 0.95).

Then the advice: the map-style job runs with num_workers=0 and its metrics JSON's
diagnosis is read; the job runs again with the num_workers it names, and the data share
of the step (the breakdown's medians, rank 0) is printed before and after.

    python benchmarks/data_readers.py --nproc 1 --repeats 5 --steps 60
    python benchmarks/data_readers.py --nproc 2 --repeats 3 --steps 60   # ddp
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import arguments, launch
from torch.utils.data import Dataset, IterableDataset, default_collate

import dtrain

SAMPLES = 4096
WORKERS = (0, 1, 2)
READERS = ("map", "stream", "shards")


def decode(samples: list[Any], ms: float, busy: bool) -> Any:
    """Collate `samples` after `ms` milliseconds of decoding each (a sleep, or with `busy`
    a CPU loop)."""
    for _ in samples:
        end = time.perf_counter() + ms / 1000
        if busy:
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(ms / 1000)
    return default_collate(samples)


def raw_samples() -> tuple[torch.Tensor, torch.Tensor]:
    """The stored samples: 64 features and one of 10 classes each."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, 64, generator=generator), torch.randint(
        0, 10, (SAMPLES,), generator=generator
    )


class MapSamples(Dataset):
    """The samples as a map-style dataset."""

    def __init__(self) -> None:
        self.x, self.y = raw_samples()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class StreamSamples(IterableDataset):
    """The same samples as a stream, in their stored order."""

    def __init__(self) -> None:
        self.x, self.y = raw_samples()

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self) -> Any:
        return zip(self.x, self.y, strict=True)


def make_model(width: int) -> torch.nn.Module:
    """An MLP of two hidden layers: at the default width about 9 ms a step of 16 samples on
    one core, about half what their decoding takes at 1 ms each."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def dataset(reader: str, shards: str) -> Any:
    """The samples as `reader` reads them (`shards`: their shard files' directory)."""
    if reader == "map":
        return MapSamples()
    if reader == "stream":
        return StreamSamples()
    return dtrain.ShardFiles(shards)


def rate(engine: Any, loader: Any, args: argparse.Namespace) -> float:
    """Samples per second of `args.steps` steps after `args.warmup` untimed ones (the
    clock stops before the loop is left: leaving it stops the workers, which takes a
    while)."""
    start = end = 0.0
    for done, batch in enumerate(engine.progress(loader), 1):
        engine.train_step(batch, F.cross_entropy)
        if done == args.warmup:
            start = time.perf_counter()
        if done == args.warmup + args.steps:
            end = time.perf_counter()
            break
    return args.steps * args.global_batch_size / (end - start)


def start_rank(args: argparse.Namespace, metrics_json: str | None = None) -> Any:
    """This rank's engine, set up with the MLP. `launch` spawns the ranks, and a spawned
    process spawns its DataLoader workers too (each importing torch anew at every
    iteration of a loader); the ranks of `dtrain run` are started as commands, whose
    workers are forked, as here."""
    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(args.threads)
    engine = dtrain.init(strategy=args.strategy, seed=0, metrics_json=metrics_json)
    model = make_model(args.width)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    return engine


def readers(args: argparse.Namespace, shards: str) -> dict[tuple[str, int], list[float]]:
    """Samples/s of every reader and worker count, `args.repeats` runs each (rank 0's)."""
    engine = start_rank(args)
    collate = functools.partial(decode, ms=args.decode_ms, busy=args.busy)
    found: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for reader in READERS:
            for workers in WORKERS:
                loader = engine.dataloader(
                    dataset(reader, shards),
                    global_batch_size=args.global_batch_size,
                    shuffle=reader != "stream",
                    num_workers=workers,
                    collate_fn=collate,
                )
                found.setdefault((reader, workers), []).append(rate(engine, loader, args))
    engine.close()
    return found


def advised(args: argparse.Namespace, workers: int, out: str) -> dict[str, Any]:
    """The map-style job at `workers` DataLoader workers: its metrics JSON and its timed
    samples/s as ``rate`` (rank 0; {} elsewhere)."""
    engine = start_rank(args, metrics_json=out)
    collate = functools.partial(decode, ms=args.decode_ms, busy=args.busy)
    loader = engine.dataloader(
        MapSamples(),
        global_batch_size=args.global_batch_size,
        num_workers=workers,
        collate_fn=collate,
    )
    samples_per_second = rate(engine, loader, args)
    engine.close()
    if not engine.is_main:
        return {}
    return {**json.loads(Path(out).read_text()), "rate": samples_per_second}


def data_share(metrics: dict[str, Any]) -> str:
    """Rank 0's wait for data against its step, from a metrics JSON's breakdown."""
    part = metrics["breakdown"][0]
    return f"data {part['data'] * 1000:.1f} ms of a {part['step'] * 1000:.1f} ms step " + (
        f"({part['data'] / part['step']:.0%})"
    )


def main() -> None:
    parser = arguments(__doc__, batch=16, steps=30, warmup=3, repeats=3)
    parser.add_argument("--decode-ms", type=float, default=1.0, help="per sample")
    parser.add_argument("--busy", action="store_true", help="decode with a CPU loop")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden layers")
    args = parser.parse_args()
    args.strategy = "single" if args.nproc == 1 else "ddp"
    print(
        f"{args.nproc} process(es) ({args.strategy}), global batch "
        f"{args.global_batch_size}, {args.decode_ms:g} ms per sample "
        f"({'CPU loop' if args.busy else 'sleep'}), MLP width {args.width}, {args.steps} "
        f"steps after {args.warmup}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        x, y = raw_samples()
        shards = dtrain.write_shards(list(zip(x, y, strict=True)), Path(tmp, "shards"), 256)
        found = launch(args.nproc, readers, args, str(shards))[0]
        print(f"\n{'reader':>8} {'workers':>8} {'samples/s':>10} {'vs map':>7}   runs")
        for reader in READERS:
            for workers in WORKERS:
                runs = found[(reader, workers)]
                median = statistics.median(runs)
                ratio = median / statistics.median(found[("map", workers)])
                cells = " ".join(f"{r:,.0f}" for r in runs)
                print(f"{reader:>8} {workers:>8} {median:>10,.0f} {ratio:>7.3f}   {cells}")
        shards_to_map = [
            statistics.median(found[("shards", w)]) / statistics.median(found[("map", w)])
            for w in WORKERS
        ]
        print(
            "shard files / map-style at num_workers "
            + ", ".join(f"{w}: {r:.3f}" for w, r in zip(WORKERS, shards_to_map, strict=True))
            + " (goal: >= 0.95)"
        )
        before = launch(args.nproc, advised, args, 0, f"{tmp}/before.json")[0]
        said = [c["message"] for c in before["diagnosis"] if c["cause"] == "data"]
        print(f"\nnum_workers=0: {data_share(before)}\n  [data] {' '.join(said) or '(none)'}")
        advice = re.search(r"Pass num_workers=(\d+)", " ".join(said))
        if advice is None:
            print("no num_workers advice: the job is not data-bound here")
            return
        workers = int(advice.group(1))
        after = launch(args.nproc, advised, args, workers, f"{tmp}/after.json")[0]
        causes = ", ".join(c["cause"] for c in after["diagnosis"]) or "none"
        print(f"num_workers={workers} (the advice): {data_share(after)}; causes left: {causes}")
        print(
            f"samples/s {before['rate']:,.0f} -> {after['rate']:,.0f}"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
