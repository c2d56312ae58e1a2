"""`dtrain bench --strategies A,B --nproc 1,2`: every strategy at every process count on
one workload, side by side in one run.

Configurations that cannot run are skipped with the launcher's own reason. The others run
in rounds, one trial of each configuration per round (A B C, A B C, ...), so that a
machine that slows down or speeds up during the bench (other jobs, heat, caches) touches
every configuration alike; the table quotes medians over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.bench import proctree
from dtrain.bench.bench_flags import check_args, parse_counts, parse_strategies
from dtrain.bench.table import (
    BASES,
    Row,
    add_scaling_efficiency,
    format_rows,
    interrupted_row,
    skipped_row,
    steady_rate,
    summarise,
    throughput_basis,
    write_table,
)
from dtrain.bench.trial import TrialResult, Workload, run_trial
from dtrain.errors import ConfigError

Layout = tuple[str, int]
"""A configuration: (strategy, processes per machine)."""


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the bench the parsed flags describe; 0 when at least one configuration ran."""
    check_args(args)
    strategies = parse_strategies(args.strategies)
    counts = parse_counts(args.nproc)
    workload = Workload.from_args(args)
    runnable, skipped = sort_grid(workload, strategies, counts)
    if not runnable:
        raise ConfigError(
            "None of the configurations can run: "
            + " ".join(f"{r.label}: {r.note}" for r in skipped.values())
            + " Choose strategies and process counts that fit together."
        )
    total = len(runnable) * args.repeats
    machines = ", ".join(workload.hosts)
    where = f"; on each of {machines} over ssh" if machines else ""
    # The count is the table's rows: the skipped configurations are rows too.
    print(
        f"dtrain bench: {workload.description}{where}\n"
        f"{len(runnable) + len(skipped)} configuration(s), {len(skipped)} skipped: "
        f"{len(runnable)} x {args.repeats} repeat(s) = {total} trials, taken in turn"
        + "".join(f"\n  skipped {r.label}: {r.note}" for r in skipped.values()),
        flush=True,
    )
    results, stop = run_rounds(workload, runnable, args)
    basis = throughput_basis([t for trials in results.values() for t in trials])
    rows = []
    for strategy in strategies:
        for nproc in counts:
            key = (strategy, nproc)
            world = nproc * workload.machines
            if key in skipped:
                rows.append(skipped[key])
            elif results[key]:
                rows.append(summarise(strategy, world, results[key], basis))
            else:
                rows.append(interrupted_row(strategy, world))
    add_scaling_efficiency(rows)
    meta = describe_run(workload, args, argv) | {"samples_per_second": BASES[basis]}
    csv_path, json_path = write_table(rows, args.out, meta)
    print(f"\n{format_rows(rows)}\nsamples/s: {BASES[basis]}.", flush=True)
    for note in notes(rows):
        print(note, flush=True)
    title = f"{workload.description}  ({meta['machine']['summary']})"
    draw_plots(rows, args.out, title, basis)
    print(f"Table in {csv_path} and {json_path}; each trial's log under {args.out / 'logs'}.")
    if stop is not None:
        return stopped(stop, sum(map(len, results.values())), total)
    return 0 if any(r.samples_per_second is not None for r in rows) else 1


def sort_grid(
    workload: Workload, strategies: list[str], counts: list[int]
) -> tuple[list[Layout], dict[Layout, Row]]:
    """The configurations that can run, in trial order, and the skipped ones' rows."""
    runnable: list[Layout] = []
    skipped: dict[Layout, Row] = {}
    for strategy in strategies:
        for nproc in counts:
            try:
                workload.check(strategy, nproc)
            except ConfigError as e:
                world = nproc * workload.machines
                skipped[(strategy, nproc)] = skipped_row(strategy, world, str(e))
            else:
                runnable.append((strategy, nproc))
    return runnable, skipped


@dataclass(frozen=True)
class Stop:
    """What ended a bench before its last trial: the trial it was in, and the error."""

    trial: str
    error: BaseException


def run_rounds(
    workload: Workload, runnable: list[Layout], args: argparse.Namespace
) -> tuple[dict[Layout, list[TrialResult]], Stop | None]:
    """Every configuration once per round, `args.repeats` rounds; a line per trial.
    Returns the results, and what stopped the rounds early (Ctrl-C, or an error of the
    bench itself; a trial's own failure is a result) or None: the trials done before it
    still make a table."""
    results: dict[Layout, list[TrialResult]] = {key: [] for key in runnable}
    total, done = len(runnable) * args.repeats, 0
    for repeat in range(args.repeats):
        for strategy, nproc in runnable:
            log = args.out / "logs" / f"{strategy}-x{nproc}-{repeat + 1}.log"
            try:
                result = run_trial(
                    workload,
                    strategy,
                    nproc,
                    repeat,
                    seed=args.seed,
                    timeout=args.timeout,
                    log_path=log,
                )
            except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - named in stopped()
                return results, Stop(f"{strategy} x{nproc} (repeat {repeat + 1})", e)
            results[(strategy, nproc)].append(result)
            done += 1
            print(
                f"[{done:>{len(str(total))}}/{total}] {progress(result, args.repeats)}", flush=True
            )
    return results, None


def stopped(stop: Stop, done: int, total: int) -> int:
    """Say which trial the bench stopped in (the table above holds the ones before it);
    return the exit code, 128 + SIGINT, for Ctrl-C. An error of the bench itself is raised
    on after that line (the command prints a DtrainError, any other with its traceback)."""
    interrupted = isinstance(stop.error, KeyboardInterrupt)
    print(
        f"dtrain bench: {'interrupted (Ctrl-C)' if interrupted else 'stopped by an error'} "
        f"during the trial {stop.trial}; the table holds the {done} of {total} trials done "
        "before it.",
        file=sys.stderr,
        flush=True,
    )
    if not interrupted:
        raise stop.error
    return 128 + signal.SIGINT


def progress(result: TrialResult, repeats: int) -> str:
    """One trial's line: its configuration, then samples/s or why it failed."""
    head = f"{result.strategy} x{result.nproc} (repeat {result.repeat + 1}/{repeats}): "
    if result.status != "ok":
        return head + f"{result.status} after {result.seconds:.1f} s: {result.note}"
    run = float(result.metrics["samples_per_second"])
    steady = steady_rate(result)
    if steady is None:
        return head + f"{run:,.0f} samples/s over the whole run ({result.seconds:.1f} s)"
    return head + (
        f"{steady:,.0f} samples/s at steady state, {run:,.0f} over the whole run "
        f"({result.seconds:.1f} s)"
    )


def notes(rows: list[Row]) -> list[str]:
    """What the table lacks and why, in full sentences."""
    ran = [r for r in rows if r.samples_per_second is not None]
    said = []
    if ran and all(r.data is None for r in ran):
        said.append(
            "The trials' metrics JSON carried no `breakdown`, so the data, forward, backward, "
            "communication, optimizer and other columns are empty, step time is the global "
            "batch over samples/s, and samples/s includes each run's first (slow) steps."
        )
    if ran and not proctree.available():
        said.append(
            "Peak resident memory per rank is read from /proc, which this system lacks, so "
            "its column is empty."
        )
    return said


def draw_plots(rows: list[Row], out: Path, title: str, basis: str) -> None:
    """Draw the plots, or say that the plots extra is missing (the table is written)."""
    from dtrain.bench import plots

    try:
        written, missing = plots.draw(rows, out, title, basis)
    except ImportError:
        print(plots.EXTRA_NOTE, flush=True)
        return
    for note in missing:
        print(note, flush=True)
    if written:
        print("Plots: " + ", ".join(str(p) for p in written), flush=True)


def describe_run(workload: Workload, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The command, workload, machine and date, stored beside the rows."""
    import torch

    if torch.cuda.is_available():
        devices = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        devices = "CPU only"
    cores = os.cpu_count()
    return {
        "command": "dtrain " + shlex.join(argv),
        "workload": workload.description,
        "hosts": list(workload.hosts),
        "repeats": args.repeats,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "summary": f"{cores} CPU cores, {devices}, torch {torch.__version__}",
            "host": platform.node(),
            "platform": platform.platform(),
            "cpu_cores": cores,
            "devices": devices,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
