"""Strategies across test hosts on shaped links: samples/s and the bytes each host sends.

Run by hand, as root (test hosts are network namespaces, tests/cluster.py), not in CI:

    python benchmarks/multihost.py [--hosts 2,3] [--rate 100mbit] [--steps 4,12]

For each host count it builds that many test hosts whose egress (eth0) is shaped to
`--rate` with tbf, and runs `dtrain demo` on every host (2 processes each, plus the servers
for ps) once per strategy: flat ddp, `--hierarchical`, zero3, hsdp (`--shard-size 2`), ps
with 1 and 2 servers per host. Each case runs twice, for the two step counts of `--steps`;
the bytes a host sent per step are the difference of its eth0 tx_bytes between the two
runs divided by the difference of the steps, so start-up, the handshake, the final
checkpoint and the evaluation (the same in both runs) cancel out. samples/s is the longer
run's own figure from `--metrics-json`. Prints a Markdown table, with the bytes per step
that each algorithm's formula predicts (S = the model's fp32 bytes) beside the measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import cluster  # noqa: E402 - the test hosts live beside the tests

PER_HOST = 2
_ports = itertools.count(29600)


@dataclass(frozen=True)
class Case:
    """One strategy's flags and the bytes per step its formula predicts per host link."""

    name: str
    flags: tuple[str, ...]
    formula: str


def cases(hosts: int) -> list[Case]:
    """The strategies compared on `hosts` hosts of PER_HOST processes."""
    n, h, g = hosts * PER_HOST, hosts, PER_HOST
    ring = f"one rank's ring share, 2(n-1)/n S = {2 * (n - 1) / n:.2f} S"
    return [
        Case("ddp (flat ring)", ("--strategy", "ddp"), ring),
        Case(
            "ddp --hierarchical",
            ("--strategy", "ddp", "--hierarchical"),
            f"leaders only: 2(h-1)/h S = {2 * (h - 1) / h:.2f} S",
        ),
        Case("zero3", ("--strategy", "zero3"), f"3(n-1)/n S = {3 * (n - 1) / n:.2f} S"),
        Case(
            "hsdp --shard-size 2",
            ("--strategy", "hsdp", "--shard-size", str(g)),
            f"g ranks x 2(h-1)/h S/g = {2 * (h - 1) / h:.2f} S",
        ),
        *(
            Case(
                f"ps, {k} server(s)/host",
                ("--strategy", "ps", "--servers", str(k * h)),
                f"push + pull 2 x g(h-1)/h S = {2 * g * (h - 1) / h:.2f} S",
            )
            for k in (1, 2)
        ),
    ]


def tx_bytes(made: cluster.Cluster, host: cluster.Host) -> int:
    """What `host` has sent on its link so far."""
    argv = ["ip", "netns", "exec", host.netns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"]
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def run(
    made: cluster.Cluster, case: Case, model: list[str], steps: int, batch: int, out: Path
) -> tuple[dict[str, object], list[int]]:
    """Run `case` on `model` (the demo's model flags) for `steps` steps on every host; its
    metrics and each host's sent bytes."""
    master = f"{made.hosts[0].name}:{next(_ports)}"
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    before = [tx_bytes(made, host) for host in made.hosts]
    procs = []
    for rank, host in enumerate(made.hosts):
        argv = [sys.executable, "-m", "dtrain.cli", "demo", *model, *case.flags]
        argv += ["--nproc", str(PER_HOST), "--nnodes", str(len(made.hosts))]
        argv += ["--node-rank", str(rank), "--master", master, "--timeout", "300"]
        argv += ["--steps", str(steps), "--global-batch-size", str(batch), "--seed", "0"]
        argv += ["--checkpoint-every", "100000", "--out", str(out / f"node{rank}")]
        argv += ["--metrics-json", str(out / f"metrics{rank}.json")]
        log = (out / f"node{rank}.log").open("w")
        procs.append(made.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    for rank, proc in enumerate(procs):
        if proc.wait(timeout=900) != 0:
            tail = (out / f"node{rank}.log").read_text()[-3000:]
            raise RuntimeError(f"{case.name}: node {rank} failed:\n{tail}")
    after = [tx_bytes(made, host) for host in made.hosts]
    metrics = json.loads((out / "metrics0.json").read_text())
    return metrics, [a - b for a, b in zip(after, before, strict=True)]


def model_bytes(model: list[str]) -> int:
    """S: the parameters of the bundled model `model` (the demo's flags) in fp32 bytes."""
    from dtrain.models import build

    size = model[3] if len(model) > 2 else None
    return 4 * sum(p.numel() for p in build(model[1], size).parameters())


def measure(
    hosts: int,
    rate: str,
    model: list[str],
    steps: tuple[int, int],
    batch: int,
    root: Path,
    only: str,
) -> list[str]:
    """The table rows for `hosts` test hosts (the cases whose name contains one of the
    comma-separated `only`)."""
    size = model_bytes(model)
    rows = []
    with cluster.cluster(hosts, rate=rate) as made:
        for case in (c for c in cases(hosts) if any(o in c.name for o in only.split(","))):
            runs = []
            for n in steps:
                out = root / f"{hosts}h-{case.flags[1]}-{len(rows)}-{n}"
                out.mkdir(parents=True)
                runs.append(run(made, case, model, n, batch, out))
            (_, short), (metrics, long) = runs
            per_step = [(b - a) / (steps[1] - steps[0]) for a, b in zip(short, long, strict=True)]
            mean = sum(per_step) / len(per_step)
            rows.append(
                f"| {hosts}x{PER_HOST} | {case.name} | {metrics['samples_per_second']:.1f} | "
                f"{' / '.join(f'{b / 1e6:.2f}' for b in per_step)} | {mean / size:.2f} S | "
                f"{case.formula} |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,3", help="host counts, comma-separated")
    parser.add_argument("--rate", default="100mbit", help="each host's egress (tc syntax)")
    parser.add_argument("--steps", default="4,12", help="the two step counts (short,long)")
    parser.add_argument("--global-batch-size", type=int, default=12)
    parser.add_argument("--model", default="gpt", help="a bundled model (gpt, cnn, mlp)")
    parser.add_argument("--model-size", default="small", help="gpt's size (ignored otherwise)")
    parser.add_argument(
        "--only", default="", help="comma-separated: run the cases whose name contains one"
    )
    args = parser.parse_args()
    # A SIGTERM ends the run through the clusters' teardown (their processes, namespaces).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("Stopped by SIGTERM."))
    why = cluster.unavailable()
    if why is not None:
        sys.exit(f"Test hosts cannot be made here ({why}); run this as root with iproute2.")
    short, long = (int(s) for s in args.steps.split(","))
    sized = ["--model-size", args.model_size] if args.model == "gpt" else []
    model = ["--model", args.model, *sized]
    print(f"S = {model_bytes(model) / 1e6:.3f} MB ({' '.join(model[1::2])}, fp32); {args.rate}")
    print("| hosts x procs | strategy | samples/s | MB/step sent per host | mean | formula |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="dtrain-multihost-") as root:
        for hosts in (int(h) for h in args.hosts.split(",")):
            steps, batch = (short, long), args.global_batch_size
            measure(hosts, args.rate, model, steps, batch, Path(root), args.only)


if __name__ == "__main__":
    main()
