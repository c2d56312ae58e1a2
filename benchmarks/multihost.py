"""Strategies across test hosts on shaped links: samples/s, bytes per host, final loss.

Run by hand, as root (test hosts are network namespaces, tests/cluster.py), not in CI:

    python benchmarks/multihost.py [--hosts 2,3] [--rate 100mbit] [--steps 32,64] \
        [--only NAME,NAME] [--repeats N]

For each host count it builds that many test hosts whose egress (eth0) is shaped to
`--rate` with tbf, and runs `dtrain demo` on every host (2 processes each, plus the servers
for ps) once per case: `single` (one process on the first host: the speed to beat), flat
ddp, with each --grad-compression (fp16, bf16, powersgd:1 and :4), `--hierarchical` (fp32
and bf16 across hosts), zero3, hsdp (`--shard-size 2`), ps with 1 and 2 servers per host,
a pipeline of one stage per process, local SGD and DiLoCo (nesterov outer optimizer)
syncing every 8
and every 32 steps. Every case trains the same samples (the long step count at the same
global batch, the demo's optimizer: adamw at lr 0.003 for gpt), so its final losses
(`train_loss`, the last step's over the global batch, and `test_loss`) stand beside flat
ddp's.

With two step counts (`--steps SHORT,LONG`) each case runs for both; the bytes a host sent
per step are the difference of its eth0 tx_bytes between the two runs divided by the
difference of the steps, so start-up, the handshake, the final checkpoint and the
evaluation (the same in both runs) cancel out. Local SGD sends only at every H-th step, so
both counts must be multiples of H (the difference then spans whole sync periods). With
one step count (`--steps LONG`) only the long run is made: bytes per step do not depend on
the link's rate, so a second rate needs no second measurement. samples/s is the long run's
own figure from `--metrics-json`; with `--repeats N` the long runs are made N times, the
cases interleaved in each round so that a drifting machine load hits them all, and the
table gives the median samples/s and the median of the per-round ratios to flat ddp.
Prints a line per run as it ends (a failed run prints its log's tail, and the next case
goes on) and then a Markdown table, with the bytes per step each algorithm's formula
predicts (S = the model's fp32 bytes) beside the measured.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from dtrain.parallel.compression import MIN_COMPRESSION_RATE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import cluster  # noqa: E402 - the test hosts live beside the tests

PER_HOST = 2
BASELINE = "ddp (flat ring)"
"""The case every other is compared with (samples/s and final loss)."""
SYNC_PERIODS = (8, 32)
"""The H of the local SGD and DiLoCo cases: optimizer steps between two syncs."""
POWERSGD_RANKS = (1, 4)
_ports = itertools.count(29600)


@dataclass(frozen=True)
class Case:
    """One strategy's flags and the bytes per step its formula predicts per host link."""

    name: str
    flags: tuple[str, ...]
    formula: str
    predicted: float
    """The formula's bytes per step per host link, in S."""
    period: int = 1
    """Steps between two exchanges: both step counts of a bytes measurement are multiples."""
    alone: bool = False
    """One process on the first host (single): what the others must beat."""


LOCAL_SGD = (
    ("local-sgd", ()),
    ("diloco", ("--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")),
)
"""Local SGD's cases: plain averaging, and DiLoCo with the paper's outer optimizer."""


def cases(hosts: int, model: list[str]) -> list[Case]:
    """The strategies compared on `hosts` hosts of PER_HOST processes, training `model`
    (the demo's model flags)."""
    n, h, g = hosts * PER_HOST, hosts, PER_HOST
    ring, leaders, zero3 = 2 * (n - 1) / n, 2 * (h - 1) / h, 3 * (n - 1) / n
    ring_text = f"one rank's ring share, 2(n-1)/n S = {ring:.2f} S"
    ddp = ("--strategy", "ddp")
    return [
        Case(BASELINE, ddp, ring_text, ring),
        Case("single", ("--strategy", "single"), "nothing (one process)", 0.0, alone=True),
        *(
            Case(f"ddp {kind}", (*ddp, "--grad-compression", kind), f"{ring_text} / 2", ring / 2)
            for kind in ("fp16", "bf16")
        ),
        *(powersgd(rank, model, ring) for rank in POWERSGD_RANKS),
        Case(
            "ddp --hierarchical",
            (*ddp, "--hierarchical"),
            f"leaders only: 2(h-1)/h S = {leaders:.2f} S",
            leaders,
        ),
        Case(
            "ddp --hierarchical bf16",
            (*ddp, "--hierarchical", "--grad-compression", "bf16"),
            f"leaders only, in bf16: 2(h-1)/h S / 2 = {leaders / 2:.2f} S",
            leaders / 2,
        ),
        Case("zero3", ("--strategy", "zero3"), f"3(n-1)/n S = {zero3:.2f} S", zero3),
        Case(
            f"pipeline --pp {n}",
            ("--strategy", "pipeline"),
            "activations and their gradients only (not a share of S)",
            0.0,
        ),
        Case(
            "hsdp --shard-size 2",
            ("--strategy", "hsdp", "--shard-size", str(g)),
            f"g ranks x 2(h-1)/h S/g = {leaders:.2f} S",
            leaders,
        ),
        *(
            Case(
                f"ps, {k} server(s)/host",
                ("--strategy", "ps", "--servers", str(k * h)),
                f"push + pull 2 x g(h-1)/h S = {g * leaders:.2f} S",
                g * leaders,
            )
            for k in (1, 2)
        ),
        *(
            local_sgd(name, every, outer, ring)
            for name, outer in LOCAL_SGD
            for every in SYNC_PERIODS
        ),
    ]


def powersgd(rank: int, model: list[str], ring: float) -> Case:
    """The case of ddp with PowerSGD at `rank`: its factors and uncompressed gradients go
    round the ring as ddp's whole gradients do."""
    share = powersgd_share(model, rank)
    return Case(
        f"ddp powersgd:{rank}",
        ("--strategy", "ddp", "--grad-compression", f"powersgd:{rank}"),
        f"2(n-1)/n x (matrices' (rows + cols) x {rank} + vectors) = {ring:.2f} x {share:.4f} S",
        ring * share,
    )


def local_sgd(name: str, every: int, outer: tuple[str, ...], ring: float) -> Case:
    """The case `name` syncing every `every` steps with the `outer` optimizer flags: one
    all-reduce of the model (the averaged replicas, or DiLoCo's outer gradient) per sync."""
    return Case(
        f"{name} H={every}",
        ("--strategy", "local-sgd", "--sync-every", str(every), *outer),
        f"{ring:.2f} S / H = {ring / every:.3f} S",
        ring / every,
        period=every,
    )


def parameters(model: list[str]) -> list[nn.Parameter]:
    """The parameters of the bundled model `model` (the demo's flags)."""
    from dtrain.models import build

    size = model[3] if len(model) > 2 else None
    return list(build(model[1], size).parameters())


def powersgd_share(model: list[str], rank: int) -> float:
    """What PowerSGD at `rank` all-reduces per step, as a fraction of the gradients: each
    gradient matrix (rows x the rest) as its factors P and Q, (rows + cols) x rank numbers,
    where those are under 1/MIN_COMPRESSION_RATE of it (torch's rule); the rest whole."""
    sent = total = 0
    for p in parameters(model):
        rows = p.shape[0]
        cols = p.numel() // rows
        r = min(rows, cols, rank)
        compressed = (rows + cols) * r
        sent += compressed if compressed * MIN_COMPRESSION_RATE < p.numel() else p.numel()
        total += p.numel()
    return sent / total


def tx_bytes(made: cluster.Cluster, host: cluster.Host) -> int:
    """What `host` has sent on its link so far."""
    argv = ["ip", "netns", "exec", host.netns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"]
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


@dataclass(frozen=True)
class Run:
    """One run of a case: its metrics (node 0's --metrics-json) and each host's sent bytes."""

    metrics: dict[str, float]
    sent: list[int]


def run(
    made: cluster.Cluster, case: Case, model: list[str], steps: int, batch: int, out: Path
) -> Run:
    """Run `case` on `model` (the demo's model flags) for `steps` steps on every host."""
    master = f"{made.hosts[0].name}:{next(_ports)}"
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    before = [tx_bytes(made, host) for host in made.hosts]
    procs = []
    try:
        for rank, host in enumerate(made.hosts[:1] if case.alone else made.hosts):
            argv = [sys.executable, "-m", "dtrain.cli", "demo", *model, *case.flags]
            if not case.alone:
                argv += ["--nproc", str(PER_HOST), "--nnodes", str(len(made.hosts))]
                argv += ["--node-rank", str(rank), "--master", master]
            argv += ["--timeout", "300"]
            argv += ["--steps", str(steps), "--global-batch-size", str(batch), "--seed", "0"]
            argv += ["--checkpoint-every", "100000", "--out", str(out / f"node{rank}")]
            argv += ["--metrics-json", str(out / f"metrics{rank}.json")]
            log = (out / f"node{rank}.log").open("w")
            procs.append(made.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        for rank, proc in enumerate(procs):
            if proc.wait(timeout=900) != 0:
                tail = (out / f"node{rank}.log").read_text()[-3000:]
                raise RuntimeError(f"{case.name}: node {rank} failed:\n{tail}")
    finally:
        # A failed node leaves the others waiting on it: stop them before the next case.
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    after = [tx_bytes(made, host) for host in made.hosts]
    metrics = json.loads((out / "metrics0.json").read_text())
    return Run(metrics, [a - b for a, b in zip(after, before, strict=True)])


def model_bytes(model: list[str]) -> int:
    """S: the parameters of the bundled model `model` (the demo's flags) in fp32 bytes."""
    return 4 * sum(p.numel() for p in parameters(model))


def load() -> str:
    """The machine's load averages (1, 5 and 15 minutes)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@dataclass(frozen=True)
class Plan:
    """What to measure on each cluster: the step counts (`short` None: no bytes), the
    global batch, the long runs' repeats, and the cases whose name contains one of `only`."""

    model: list[str]
    short: int | None
    long: int
    batch: int
    repeats: int
    only: list[str]

    def chosen(self, hosts: int) -> list[Case]:
        """The cases to run on `hosts` hosts."""
        return [c for c in cases(hosts, self.model) if any(o in c.name for o in self.only)]


def measure(hosts: int, rate: str, plan: Plan, root: Path) -> list[str]:
    """The table rows for `hosts` test hosts: each chosen case's short run (for the bytes)
    and `plan.repeats` rounds of every case's long run."""
    chosen = plan.chosen(hosts)
    print(f"{hosts} hosts: load average {load()} before", flush=True)
    short: dict[str, list[int]] = {}
    rounds: list[dict[str, Run]] = []
    with cluster.cluster(hosts, rate=rate) as made:

        def attempt(case: Case, steps: int, label: str) -> Run | None:
            out = root / f"{hosts}h-{chosen.index(case)}-{label}"
            out.mkdir(parents=True)
            try:
                done = run(made, case, plan.model, steps, plan.batch, out)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"  {case.name}, {steps} steps ({label}): FAILED: {error}", flush=True)
                return None
            m = done.metrics
            print(
                f"  {case.name}, {steps} steps ({label}): {m['samples_per_second']:.1f} "
                f"samples/s, train loss {m['train_loss']:.4f}, test loss {m['test_loss']:.4f}, "
                f"sent {' / '.join(f'{b / 1e6:.2f}' for b in done.sent)} MB; load {load()}",
                flush=True,
            )
            return done

        if plan.short is not None:
            for case in chosen:
                if (done := attempt(case, plan.short, "short")) is not None:
                    short[case.name] = done.sent
        for k in range(plan.repeats):
            runs = {case.name: attempt(case, plan.long, f"round{k + 1}") for case in chosen}
            rounds.append({name: done for name, done in runs.items() if done is not None})
    print(f"{hosts} hosts: load average {load()} after", flush=True)
    size = model_bytes(plan.model)
    return [row(hosts, case, plan, size, short.get(case.name), rounds) for case in chosen]


def row(
    hosts: int,
    case: Case,
    plan: Plan,
    size: int,
    short: list[int] | None,
    rounds: list[dict[str, Run]],
) -> str:
    """The table row of `case`: median samples/s (each round's after it) and median ratio
    to the baseline over the rounds, bytes per step (from the short run and the first
    round's long run), final losses (the first round's) and their ratios to the baseline's."""
    runs = [r[case.name] for r in rounds if case.name in r]
    if not runs:
        return f"| {hosts}x{PER_HOST} | {case.name} | failed | | | | | | |"
    speeds = [r.metrics["samples_per_second"] for r in runs]
    each = f" ({', '.join(f'{v:.1f}' for v in speeds)})" if len(speeds) > 1 else ""
    ratios = [
        r[case.name].metrics["samples_per_second"] / r[BASELINE].metrics["samples_per_second"]
        for r in rounds
        if case.name in r and BASELINE in r
    ]
    base = next((r[BASELINE] for r in rounds if BASELINE in r), None)
    cells = [
        f"{hosts}x{PER_HOST}",
        case.name,
        f"{statistics.median(speeds):.1f}{each}",
        f"{statistics.median(ratios):.2f}x" if ratios else "-",
        *bytes_cells(plan, size, short, runs[0].sent),
        f"{case.predicted:.3f} S: {case.formula}",
        *(loss(runs[0], base, key) for key in ("train_loss", "test_loss")),
    ]
    return "| " + " | ".join(cells) + " |"


def bytes_cells(plan: Plan, size: int, short: list[int] | None, long: list[int]) -> list[str]:
    """Each host's MB sent per step between the short and the long run, and their mean in S."""
    if short is None or plan.short is None:
        return ["not measured", "-"]
    per_step = [(b - a) / (plan.long - plan.short) for a, b in zip(short, long, strict=True)]
    mean = sum(per_step) / len(per_step)
    return [" / ".join(f"{b / 1e6:.3f}" for b in per_step), f"{mean / size:.3f} S"]


def loss(done: Run, base: Run | None, key: str) -> str:
    """The final loss `key` of `done`, and its ratio to the baseline's."""
    value = done.metrics[key]
    return f"{value:.4f}" + ("" if base is None else f" ({value / base.metrics[key]:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,3", help="host counts, comma-separated")
    parser.add_argument("--rate", default="100mbit", help="each host's egress (tc syntax)")
    parser.add_argument(
        "--steps",
        default="32,64",
        help="the two step counts (short,long), multiples of every chosen case's sync "
        "period; or the long one alone (no bytes measured)",
    )
    parser.add_argument("--global-batch-size", type=int, default=12)
    parser.add_argument("--model", default="gpt", help="a bundled model (gpt, cnn, mlp)")
    parser.add_argument("--model-size", default="small", help="gpt's size (ignored otherwise)")
    parser.add_argument(
        "--only", default="", help="comma-separated: run the cases whose name contains one"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the long runs")
    args = parser.parse_args()
    # A SIGTERM ends the run through the clusters' teardown (their processes, namespaces).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("Stopped by SIGTERM."))
    why = cluster.unavailable()
    if why is not None:
        sys.exit(f"Test hosts cannot be made here ({why}); run this as root with iproute2.")
    counts = [int(s) for s in args.steps.split(",")]
    sized = ["--model-size", args.model_size] if args.model == "gpt" else []
    plan = Plan(
        model=["--model", args.model, *sized],
        short=counts[0] if len(counts) == 2 else None,
        long=counts[-1],
        batch=args.global_batch_size,
        repeats=args.repeats,
        only=args.only.split(","),
    )
    host_counts = [int(h) for h in args.hosts.split(",")]
    check_periods(plan, host_counts)
    print(
        f"S = {model_bytes(plan.model) / 1e6:.3f} MB ({' '.join(plan.model[1::2])}, fp32); "
        f"{args.rate}; global batch {plan.batch}; steps {args.steps}; {plan.repeats} round(s)"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtrain-multihost-") as root:
        for hosts in host_counts:
            rows += measure(hosts, args.rate, plan, Path(root))
    print(
        "| hosts x procs | case | samples/s (median) | x flat ddp (median ratio) | MB/step "
        "sent per host | measured | predicted (formula) | train loss (x ddp) | "
        "test loss (x ddp) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def check_periods(plan: Plan, host_counts: list[int]) -> None:
    """Exit with what to do if a chosen case syncs at steps the step counts do not hold
    whole periods of (its bytes per step, or its final sync, would be wrong)."""
    for hosts in host_counts:
        for case in plan.chosen(hosts):
            counts = [plan.long] if plan.short is None else [plan.short, plan.long]
            if any(steps % case.period for steps in counts):
                sys.exit(
                    f"{case.name} syncs every {case.period} steps; give --steps counts that are "
                    f"multiples of {case.period} (e.g. {case.period * 4},{case.period * 8}), or "
                    "leave the case out with --only."
                )


if __name__ == "__main__":
    main()
