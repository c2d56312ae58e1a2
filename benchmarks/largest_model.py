"""Models larger than one process's memory: the deepest GPT each strategy trains under a
per-process memory cap, setup's peak with and without `engine.init_empty`, and activation
checkpointing against `torch.utils.checkpoint` applied by hand.

1. Largest depth under a cap. Every worker caps its own private writable memory
   (``RLIMIT_DATA``, what malloc and torch's CPU allocator draw from; ``RLIMIT_AS`` would
   also count the address space torch's libraries reserve) at what it holds once torch,
   dtrain and its process group are up plus ``--budget`` MiB, so every configuration has
   the same room for its model (a cap the same for all would charge the configurations
   with more process groups for their threads' stacks, reserved but untouched). A trial
   builds a GPT of fixed width and ``depth`` blocks (on the meta device where the column
   says meta), sets it up and trains ``--steps`` steps of AdamW in fresh processes; it
   fails when any rank cannot allocate. The depth is found by doubling from a guess, then
   bisection. Beside dtrain, plain FSDP2 as a user writes it: built on the meta device,
   `fully_shard` on every block then the root, ``to_empty`` and every module's
   ``reset_parameters()``. Goal: zero3 on 4 processes trains at least 3x the depth of one
   process (ZeRO's N-fold claim).
2. Setup's peak per rank under zero3 on 4 processes, the model built on the meta device
   against built whole, and plain FSDP2 (peak resident memory, VmHWM, reset when the
   process group is up).
3. Activation checkpointing in one process: peak resident memory a training step adds
   and step time (wall and CPU), dtrain's ``--activation-checkpointing`` against the same
   blocks under ``torch.utils.checkpoint`` by hand (and neither), run alternately.

Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the
system and resident memory follows what is held. Memory figures do not depend on the
machine's load; times do (on a shared machine, read CPU times and the trial counts, not
the seconds).

    python benchmarks/largest_model.py
    python benchmarks/largest_model.py --tables 1 --only single zero3 --budget 64
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import resource
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import dtrain
from dtrain.models.gpt import GPT, GPTConfig, lm_loss

MIB = 2**20
OUT_OF_MEMORY = (
    "can't allocate memory",
    "Cannot allocate memory",
    "MemoryError",
    "std::bad_alloc",
    "out of memory",
)
"""What a rank that ran out of its cap reports (torch's allocator, Python, C++)."""


@dataclass(frozen=True)
class Shape:
    """The GPT's width and the training run every trial makes."""

    dim: int
    heads: int
    context: int
    batch: int
    """Global batch (sequences); the data-parallel ranks split it."""
    steps: int

    def config(self, depth: int) -> GPTConfig:
        """The GPT of this width with `depth` blocks."""
        return GPTConfig(dim=self.dim, heads=self.heads, context=self.context, layers=depth)

    def parameters(self, depth: int) -> int:
        """Parameters of the GPT with `depth` blocks."""
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(self.config(depth)).parameters())

    def batch_of(self, step: int, parts: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `part` of `parts` of step `step`'s global batch (inputs, targets)."""
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (self.batch, self.context + 1), generator=g)
        rows = tokens.chunk(parts)[part]
        return rows[:, :-1], rows[:, 1:]


@dataclass(frozen=True)
class Column:
    """One configuration of table 1."""

    label: str
    nproc: int
    strategy: str
    """A dtrain strategy, or "fsdp2" for plain FSDP2 written by hand."""
    checkpointing: str = "none"
    meta: bool = True
    """Build the model on the meta device (dtrain: inside `engine.init_empty`)."""
    options: tuple[tuple[str, Any], ...] = ()
    """More `dtrain.init` options."""


def columns() -> list[Column]:
    """Table 1's configurations, each without and with activation checkpointing, and zero3
    on 4 processes with the model built whole."""
    bases = [
        Column("single", 1, "single"),
        Column("zero3", 2, "zero3"),
        Column("zero3", 4, "zero3"),
        Column("hsdp, shard-size 2", 4, "hsdp", options=(("shard_size", 2),)),
        Column("pipeline", 2, "pipeline"),
        Column("pipeline", 4, "pipeline"),
        Column("plain FSDP2", 4, "fsdp2"),
    ]
    both = [
        Column(c.label, c.nproc, c.strategy, mode, c.meta, c.options)
        for c in bases
        for mode in ("none", "full")
    ]
    return both[:6] + [Column("zero3, built whole", 4, "zero3", meta=False)] + both[6:]


# -- in every worker ------------------------------------------------------------------------
def memory() -> dict[str, int]:
    """This process's private writable memory (VmData), resident memory (VmRSS) and peak
    resident memory since the last `reset_peak` (VmHWM), in bytes."""
    wanted = {"VmData": "data", "VmRSS": "rss", "VmHWM": "peak"}
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in wanted:
                found[wanted[key]] = int(value.split()[0]) * 1024
    return found


def reset_peak() -> None:
    """Start VmHWM again from the resident memory now (Linux's clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def cap(budget_mib: int | None) -> dict[str, int]:
    """Allow this process `budget_mib` MiB of private writable memory beyond what it holds
    now (no cap with None); return its memory now, the peak reset."""
    reset_peak()
    now = memory()
    if budget_mib is not None:
        limit = now["data"] + budget_mib * MIB
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    return now


def phase(phases: dict[str, dict[str, int]], name: str) -> None:
    """Record memory at the end of phase `name` (its peak since the last phase), then start
    the next phase's peak."""
    phases[name] = memory()
    reset_peak()


def train_dtrain(
    column: Column, shape: Shape, depth: int, budget: int | None
) -> dict[str, dict[str, int]]:
    """Build, set up and train the GPT of `depth` blocks with dtrain as `column` says;
    memory at each phase."""
    engine = dtrain.init(
        strategy=column.strategy,
        activation_checkpointing=column.checkpointing,
        seed=0,
        **dict(column.options),
    )
    phases = {"init": cap(budget)}
    with engine.init_empty() if column.meta else contextlib.nullcontext():
        model = GPT(shape.config(depth))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    phase(phases, "build")
    model, optimizer = engine.setup(model, optimizer)
    phase(phases, "setup")
    for step in range(shape.steps):
        batch = shape.batch_of(step, engine.dp_size, engine.strategy.dp_rank)
        engine.train_step(batch, lm_loss)
    phase(phases, "train")
    del model, optimizer
    engine.close()
    return phases


def train_fsdp2(
    column: Column, shape: Shape, depth: int, budget: int | None
) -> dict[str, dict[str, int]]:
    """The same with plain FSDP2 as a user writes it: built on the meta device, every block
    (checkpointed by torch's wrapper with --activation-checkpointing full) then the root
    sharded, storage for the shards, each module's reset_parameters()."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    phases = {"init": cap(budget)}
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(shape.config(depth))
    phase(phases, "build")
    if column.checkpointing == "full":
        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    phase(phases, "setup")
    for step in range(shape.steps):
        inputs, targets = shape.batch_of(step, dist.get_world_size(), dist.get_rank())
        lm_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    phase(phases, "train")
    dist.destroy_process_group()
    return phases


def train(column: Column, shape: Shape, depth: int, budget: int | None) -> dict:
    """One rank of a trial of `column`."""
    run = train_fsdp2 if column.strategy == "fsdp2" else train_dtrain
    return run(column, shape, depth, budget)


# -- fresh processes for every trial -------------------------------------------------------
@dataclass
class Outcome:
    """How the ranks of one trial ended."""

    results: list[Any] | None
    """Every rank's result, or None if the trial failed."""
    failure: str = ""
    """Why it failed: "out of memory (where)" if any rank ran out of its cap, else the
    first failed rank's report."""
    seconds: float = 0.0


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, log: str, args: tuple, out: Connection
) -> None:
    """A worker: the environment `dtrain run` gives, output to `log`, one result sent."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    with open(log, "a") as sink:  # the engine's banner and summary, torch's warnings
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    torch.set_num_threads(1)
    try:
        report: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as error:  # noqa: BLE001 - sent to the parent, which judges it
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY,) * 2)
        ours = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__]
        where = f"at `{ours[-1].line}`\n" if ours else ""
        report = ("error", where + traceback.format_exc())
    out.send(report)
    out.close()
    os._exit(0)  # not the exit handlers: another rank may be gone


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trial(nproc: int, fn: Callable[..., Any], *args: Any, timeout: float) -> Outcome:
    """`fn(*args)` on `nproc` fresh ranks; the others are stopped 5 s after one fails."""
    ctx = mp.get_context("forkserver")
    port = free_port()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as logs:
        pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, nproc, port, f"{logs}/rank{r}", args, pipes[r][1]),
                daemon=True,
            )
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        for _, send in pipes:
            send.close()
        reports = _collect([recv for recv, _ in pipes], procs, timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        tails = [_tail(f"{logs}/rank{r}") for r in range(nproc)]
    seconds = time.perf_counter() - start
    if all(status == "ok" for status, _ in reports):
        return Outcome([value for _, value in reports], seconds=seconds)
    texts = [f"rank {r}: {v}\n{tails[r]}" for r, (s, v) in enumerate(reports) if s != "ok"]
    oom = [t for t in texts if any(mark in t for mark in OUT_OF_MEMORY)]
    if oom:  # its first line says where, when the rank could say it
        where = oom[0].split("\n", 1)[0]
        return Outcome(None, f"out of memory ({where})", seconds)
    return Outcome(None, texts[0], seconds)


def _collect(
    pipes: list[Connection], procs: list[mp.process.BaseProcess], timeout: float
) -> list[tuple[str, Any]]:
    """Each rank's (status, value): ("ok", result), ("error", traceback), ("died", exit
    code) or ("hung", seconds) for a rank still running at the deadline."""
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs) and time.monotonic() < deadline:
        waiting = {
            obj: r
            for r, (pipe, p) in enumerate(zip(pipes, procs, strict=True))
            if r not in reports
            for obj in (pipe, p.sentinel)
        }
        for obj in wait(list(waiting), timeout=deadline - time.monotonic()):
            r = waiting[obj]
            if r in reports:
                continue
            try:
                reports[r] = pipes[r].recv()
            except EOFError:  # ended without a word: killed (out of memory in C++, a signal)
                procs[r].join()
                reports[r] = ("died", f"exit code {procs[r].exitcode}")
            if reports[r][0] != "ok":
                deadline = min(deadline, time.monotonic() + 5.0)
    return [reports.get(r, ("hung", f"no result in {timeout:.0f} s")) for r in range(len(procs))]


def _tail(path: str, chars: int = 2000) -> str:
    """The end of a worker's output (a C++ abort writes its reason there)."""
    if not os.path.exists(path):  # the worker died before it could open it
        return ""
    with open(path, errors="replace") as log:
        return log.read()[-chars:]


# -- table 1: the deepest model under the cap -------------------------------------------------
def deepest(fits: Callable[[int], bool], guess: int, ceiling: int) -> int:
    """The largest depth <= `ceiling` that fits (0 if none), taking fitting to be monotone:
    from `guess`, double while it fits (or halve until it does), then bisect."""
    depth = max(1, min(guess, ceiling))
    if fits(depth):
        good, bad = depth, None
        while bad is None and good < ceiling:
            depth = min(2 * good, ceiling)
            good, bad = (depth, None) if fits(depth) else (good, depth)
        if bad is None:
            return good
    else:
        good, bad = 0, depth
        while good == 0 and bad > 1:
            depth = bad // 2
            good, bad = (depth, bad) if fits(depth) else (0, depth)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


@dataclass
class Found:
    """Table 1's row of one column."""

    column: Column
    depth: int
    trials: int
    seconds: float
    phases: list[dict[str, dict[str, int]]]
    """Every rank's memory by phase in the deepest trial that fit (none if none did)."""

    def baseline(self, kind: str) -> float:
        """MiB of `kind` (data or rss) when the cap was set, largest rank."""
        return max((ranks["init"][kind] for ranks in self.phases), default=0) / MIB

    def peak(self) -> float:
        """MiB of resident memory at the trial's peak over its baseline, largest rank."""
        grown = [max(p["peak"] for p in r.values()) - r["init"]["rss"] for r in self.phases]
        return max(grown, default=0) / MIB


def search(column: Column, shape: Shape, args: argparse.Namespace, guess: int) -> Found:
    """The deepest GPT `column` trains under the cap."""
    trials: list[Outcome] = []
    fitted: dict[int, list[dict[str, dict[str, int]]]] = {}

    def fits(depth: int) -> bool:
        outcome = run_trial(
            column.nproc, train, column, shape, depth, args.budget, timeout=args.timeout
        )
        trials.append(outcome)
        verdict = "fits" if outcome.results is not None else outcome.failure.strip()
        print(
            f"  {describe(column)}: depth {depth}: {verdict} ({outcome.seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        if outcome.results is None and not outcome.failure.startswith("out of memory"):
            raise RuntimeError(f"{describe(column)} at depth {depth} failed:\n{outcome.failure}")
        if outcome.results is not None:
            fitted[depth] = outcome.results
        return outcome.results is not None

    depth = deepest(fits, guess, args.max_depth)
    seconds = sum(t.seconds for t in trials)
    return Found(column, depth, len(trials), seconds, fitted.get(depth, []))


def describe(column: Column) -> str:
    """A column's name in the progress lines."""
    init = "meta" if column.meta else "whole"
    return f"{column.label} x{column.nproc} ({init}, checkpointing {column.checkpointing})"


def guess_for(column: Column, rows: list[Found], first: int) -> int:
    """Where to start searching `column`: the depth found with the same process count and
    checkpointing, else the last one found with the same checkpointing (else any) scaled
    by the process counts (sharding and stages divide the model), else `first`."""
    same = [
        r
        for r in rows
        if (r.column.nproc, r.column.checkpointing) == (column.nproc, column.checkpointing)
    ]
    if same:
        return same[-1].depth
    alike = [r for r in rows if r.column.checkpointing == column.checkpointing] or rows
    if alike:
        return max(1, alike[-1].depth * column.nproc // alike[-1].column.nproc)
    return first


def table_depth(shape: Shape, args: argparse.Namespace) -> list[Found]:
    """Table 1: search every column (or those --only names)."""
    rows: list[Found] = []
    for column in columns():
        if args.only and not any(word in describe(column) for word in args.only):
            continue
        rows.append(search(column, shape, args, guess_for(column, rows, args.guess)))
    return rows


def print_depth(rows: list[Found], shape: Shape, args: argparse.Namespace) -> None:
    """Table 1, each depth beside single's with the same checkpointing."""
    print(
        f"\n1. Deepest GPT (dim {shape.dim}, {shape.heads} heads, context {shape.context}, "
        f"global batch {shape.batch}, {shape.steps} AdamW steps, fp32) under a cap of "
        f"{args.budget} MiB of private writable memory (RLIMIT_DATA) per process beyond "
        "what it holds with torch, dtrain and its process group up (base data, base RSS: "
        "then, MiB; peak: resident MiB over base RSS at the deepest fit; largest rank)"
    )
    print(
        f"{'configuration':<20} {'N':>2} {'init':>5} {'ckpt':>4} {'depth':>5} {'params':>7} "
        f"{'x single':>8} {'base data':>9} {'base RSS':>8} {'peak':>5} {'trials':>6} "
        f"{'seconds':>7}"
    )
    singles = {r.column.checkpointing: r.depth for r in rows if r.column.strategy == "single"}
    for r in rows:
        c = r.column
        single = singles.get(c.checkpointing)
        ratio = f"{r.depth / single:.2f}" if single else "-"
        params = f"{shape.parameters(r.depth) / 1e6:.1f}M" if r.depth else "-"
        print(
            f"{c.label:<20} {c.nproc:>2} {'meta' if c.meta else 'whole':>5} "
            f"{c.checkpointing:>4} {r.depth:>5} {params:>7} {ratio:>8} "
            f"{r.baseline('data'):>9.0f} {r.baseline('rss'):>8.0f} {r.peak():>5.0f} "
            f"{r.trials:>6} {r.seconds:>7.0f}"
        )


# -- table 2: setup's peak, meta against whole ---------------------------------------------
def table_setup(shape: Shape, args: argparse.Namespace) -> None:
    """Table 2: zero3 on 4 processes, no cap, the model built on the meta device or whole
    (and plain FSDP2 on the meta device); each rank's peak while building and while
    setting up, and what it holds after, over its resident memory with the group up."""
    depth = args.setup_depth
    psi = shape.parameters(depth)
    print(
        f"\n2. Resident memory per rank over the baseline with the process group up, zero3 on "
        f"4 processes, GPT of depth {depth} (dim {shape.dim}, {psi / 1e6:.1f}M parameters, "
        f"{4 * psi / MIB:.0f} MiB fp32 whole, {psi / MIB:.0f} MiB per rank sharded); MiB"
    )
    print(
        f"{'run':<18} {'rank':>4} {'base RSS':>8} {'build peak':>10} {'setup peak':>10} "
        f"{'after setup':>11}"
    )
    setup_only = Shape(**{**vars(shape), "steps": 0})
    runs = {
        "dtrain, meta": Column("zero3", 4, "zero3"),
        "dtrain, whole": Column("zero3", 4, "zero3", meta=False),
        "plain FSDP2, meta": Column("plain FSDP2", 4, "fsdp2"),
    }
    for name, column in runs.items():
        outcome = run_trial(4, train, column, setup_only, depth, None, timeout=args.timeout)
        if outcome.results is None:
            raise RuntimeError(f"{name} setup at depth {depth} failed:\n{outcome.failure}")
        for rank, phases in enumerate(outcome.results):
            base = phases["init"]["rss"]
            build, setup = ((phases[k]["peak"] - base) / MIB for k in ("build", "setup"))
            after = (phases["setup"]["rss"] - base) / MIB
            print(
                f"{name:<18} {rank:>4} {base / MIB:>8.0f} {build:>10.1f} {setup:>10.1f} "
                f"{after:>11.1f}"
            )


# -- table 3: activation checkpointing ---------------------------------------------------------
def checkpointed(index: int, mode: str) -> bool:
    """Whether block `index` is checkpointed under `mode` (selective: every other one, the
    second, fourth, ..., as dtrain chooses)."""
    return mode == "full" or (mode == "selective" and index % 2 == 1)


class ByHand:
    """The GPT trained in a plain loop, its blocks under torch.utils.checkpoint by hand."""

    def __init__(self, model: GPT, mode: str) -> None:
        self.model, self.mode = model, mode
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        x = self.model.embed(inputs)
        for i, block in enumerate(self.model.blocks):
            if checkpointed(i, self.mode):
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        lm_loss(self.model.head(x), targets).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class ByDtrain:
    """The same GPT through dtrain with --activation-checkpointing `mode`."""

    def __init__(self, model: GPT, mode: str) -> None:
        self.engine = dtrain.init(strategy="single", activation_checkpointing=mode)
        self.engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.engine.train_step(batch, lm_loss)


def measure_checkpointing(shape: Shape, depth: int, rounds: int) -> dict[str, list[dict]]:
    """The peak bytes a step adds, its wall seconds and its CPU seconds, in every round, of
    each variant; the variants run in turn within a round, in reverse order every other
    round. CPU time is the work of this (one-thread) process, which other jobs on the
    machine do not stretch as they stretch wall time."""
    variants: dict[str, ByHand | ByDtrain] = {}
    for mode in ("none", "full", "selective"):
        for kind in (ByHand, ByDtrain):
            torch.manual_seed(0)
            variants[f"{kind.__name__} {mode}"] = kind(GPT(shape.config(depth)), mode)
    samples: dict[str, list[dict]] = {name: [] for name in variants}
    order = list(variants)
    for step in range(rounds + 1):  # the first round warms up (and creates AdamW's state)
        batch = shape.batch_of(step, 1, 0)
        for name in order if step % 2 == 0 else reversed(order):
            reset_peak()
            before = memory()["rss"]
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name].step(batch)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if step:
                samples[name].append({"peak": memory()["peak"] - before, "wall": wall, "cpu": cpu})
    return samples


def table_checkpointing(shape: Shape, args: argparse.Namespace) -> None:
    """Table 3 from one fresh process."""
    depth = args.ac_depth
    outcome = run_trial(1, measure_checkpointing, shape, depth, args.rounds, timeout=args.timeout)
    if outcome.results is None:
        raise RuntimeError(f"the checkpointing measurement failed:\n{outcome.failure}")
    samples = outcome.results[0]
    print(
        f"\n3. Activation checkpointing, one process, GPT of depth {depth} (dim {shape.dim}, "
        f"context {shape.context}, batch {shape.batch}): resident memory a training step "
        f"adds at its peak, and its time; medians of {args.rounds} alternating rounds (ratios: "
        "of each round's pair). hand: a plain loop, the same blocks under "
        "torch.utils.checkpoint(use_reentrant=False)"
    )
    print(
        f"{'variant':<16} {'peak MiB':>8} {'saved MiB':>9} {'wall s':>7} {'CPU s':>7} "
        f"{'wall x none':>11} {'CPU x none':>10} {'CPU x hand':>10}"
    )
    for name, rows in samples.items():
        kind, mode = name.split()
        none = samples[f"{kind} none"]
        hand = samples[f"ByHand {mode}"]
        peak = statistics.median(row["peak"] for row in rows) / MIB
        saved = statistics.median(row["peak"] for row in none) / MIB - peak
        against = "-" if kind == "ByHand" else f"{per_round(rows, hand, 'cpu'):.2f}"
        print(
            f"{kind.removeprefix('By').lower() + ' ' + mode:<16} {peak:>8.1f} {saved:>9.1f} "
            f"{statistics.median(row['wall'] for row in rows):>7.3f} "
            f"{statistics.median(row['cpu'] for row in rows):>7.3f} "
            f"{per_round(rows, none, 'wall'):>11.2f} {per_round(rows, none, 'cpu'):>10.2f} "
            f"{against:>10}"
        )


def per_round(rows: list[dict], against: list[dict], key: str) -> float:
    """The median over rounds of `rows`' `key` over `against`'s in the same round (run
    side by side, the two share the machine's state of that moment)."""
    return statistics.median(a[key] / b[key] for a, b in zip(rows, against, strict=True))


# -- main -------------------------------------------------------------------------------------
def machine() -> str:
    """The CPU model and core count."""
    name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        name = next((line.split(":", 1)[1].strip() for line in info if "model name" in line), name)
    return (
        f"machine: {name}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Linux {platform.release()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial")
    parser.add_argument("--budget", type=int, default=96, help="MiB per process (table 1)")
    parser.add_argument("--guess", type=int, default=4, help="first depth tried (table 1)")
    parser.add_argument("--max-depth", type=int, default=512)
    parser.add_argument(
        "--only", nargs="*", default=[], help="table 1: columns whose name contains a word"
    )
    parser.add_argument("--setup-depth", type=int, default=64, help="table 2's depth")
    parser.add_argument("--ac-depth", type=int, default=8, help="table 3's depth")
    parser.add_argument("--rounds", type=int, default=10, help="table 3's timed rounds")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per trial")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # before the fork server starts
    # Every trial's workers fork from one process that has torch and dtrain imported.
    mp.set_forkserver_preload(["__main__", "dtrain.engine.start"])
    shape = Shape(args.dim, args.heads, args.context, args.batch, args.steps)
    print("command: python " + shlex.join(sys.argv))
    print(machine())
    if 1 in args.tables:
        print_depth(table_depth(shape, args), shape, args)
    if 2 in args.tables:
        table_setup(shape, args)
    if 3 in args.tables:
        table_checkpointing(shape, args)


if __name__ == "__main__":
    main()
