"""Validate `dtrain plan` across machines: test hosts on a shaped link, every candidate run.

Run by hand, as root (the test hosts are network namespaces, tests/cluster.py):

    OMP_NUM_THREADS=1 python benchmarks/plan_validation_hosts.py --rate 100mbit --models gpt-small

The runs are kept in --cache (JSON), so that a change of the cost model can be checked
against them with --reuse (no test hosts are made then).

It builds `--hosts` test hosts whose links are shaped to `--rate` with tbf, asks `dtrain
plan --nproc 1 --nnodes H` for the candidates, telling it the link (`--inter-node-gbps`
from the rate; the planner does not measure between machines), then runs every candidate
with `dtrain demo` on every host (node ranks and `--master` filled in) and sets the
samples/s node 0 reports against the prediction, as `plan_validation.py` does on one
machine. One process per host: the hosts share this machine's cores, so more would measure
the cores, not the link.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import cluster  # noqa: E402 - the test hosts live beside the tests
import plan_plot  # noqa: E402
from plan_validation import MODELS, dtrain, load, model_states, optimizer_of, table  # noqa: E402

from dtrain.plan.layouts import MASTER_PLACEHOLDER  # noqa: E402

STEPS = {"mlp": 100, "gpt-small": 12}
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_ports = itertools.count(29700)


def gigabytes_per_second(rate: str) -> float:
    """tc's rate (``100mbit``) in GB/s, as `dtrain plan --inter-node-gbps` takes it."""
    for unit, bits in _UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * bits / 8 / 1e9
    raise SystemExit(f"--rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit.")


def plan(model: list[str], hosts: int, rate: str, latency_us: float) -> dict:
    """`dtrain plan --json` for one process on each of `hosts` machines linked at `rate`."""
    done = dtrain(
        "plan", *model, "--nproc", "1", "--nnodes", str(hosts), "--json",
        "--inter-node-gbps", str(gigabytes_per_second(rate)),
        "--inter-node-latency-us", str(latency_us),
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"dtrain plan failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def measure(
    made: cluster.Cluster, model: list[str], candidate: dict, steps: int, batch: int
) -> dict | None:
    """samples/s (node 0's figure) and the fullest rank's model-state bytes of one run of
    `candidate` on every host it spans (one host for a layout of one machine, such as
    `single`), or None if it failed."""
    master = f"{made.hosts[0].name}:{next(_ports)}"
    flags = shlex.split(candidate["flags"].replace(MASTER_PLACEHOLDER, master))
    hosts = made.hosts if "--nnodes" in flags else made.hosts[:1]
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="plan-hosts-") as tmp:
        out = Path(tmp)
        procs = []
        for rank, host in enumerate(hosts):
            argv = [sys.executable, "-m", "dtrain.cli", "demo", *model, *flags]
            argv += ["--node-rank", str(rank)] if len(hosts) > 1 else []
            argv += ["--timeout", "300", "--seed", "0"]
            argv += ["--optimizer", candidate["optimizer"], "--global-batch-size", str(batch)]
            argv += ["--steps", str(steps), "--checkpoint-every", "100000", "--memory-report"]
            argv += ["--out", str(out / f"node{rank}")]
            argv += ["--metrics-json", str(out / f"metrics{rank}.json")]
            log = (out / f"node{rank}.log").open("w")
            procs.append(made.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=900) for proc in procs]
        if any(codes):
            failed = codes.index(next(c for c in codes if c))
            tail = (out / f"node{failed}.log").read_text()[-1500:]
            print(f"  failed: {candidate['flags']} (node {failed})\n{tail}", file=sys.stderr)
            return None
        result = json.loads((out / "metrics0.json").read_text())
        return {
            "samples_per_second": float(result["samples_per_second"]),
            "memory": model_states(result.get("memory") or []),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="100mbit", help="Each host's link, in tc's syntax.")
    parser.add_argument(
        "--latency-us",
        type=float,
        default=100.0,
        help="The link's latency the planner is told (between namespaces on one machine, "
        "about 0.1 ms).",
    )
    parser.add_argument("--models", default="gpt-small", help="mlp, gpt-small")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--cache", type=Path, default=Path("runs/plan_validation_hosts.json"))
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="Predict anew against the cached runs; run nothing (no test hosts are made).",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="Also draw predicted against measured (PNG)."
    )
    args = parser.parse_args()
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    points: list[plan_plot.Point] = []
    if args.reuse:
        for name in args.models.split(","):
            result = plan(MODELS[name], args.hosts, args.rate, args.latency_us)
            runs = cache[name]
            points += report(name, args, result, runs["measured"], runs["memory"])
    else:
        points = run_all(args, cache)
    if args.plot and points:
        title = f"dtrain plan on {args.hosts} test hosts x 1 process, links at {args.rate}"
        plan_plot.draw(points, args.plot, title)


def run_all(args: argparse.Namespace, cache: dict) -> list[plan_plot.Point]:
    """Make the test hosts, run every candidate of every model there, keep the runs in
    the cache, print each model's table; the plotted points."""
    points: list[plan_plot.Point] = []
    with cluster.cluster(args.hosts, rate=args.rate) as made:
        for name in args.models.split(","):
            model = MODELS[name]
            result = plan(model, args.hosts, args.rate, args.latency_us)
            optimizer = optimizer_of(result)
            measured: dict[str, list[float]] = {}
            memory: dict[str, int] = {}
            print(f"load before: {load()}", flush=True)
            for repeat in range(args.repeats):
                for c in result["candidates"]:
                    steps = args.steps or STEPS[name]
                    got = measure(made, model, {**c, "optimizer": optimizer}, steps,
                                  result["global_batch_size"])  # fmt: skip
                    if got is not None:
                        measured.setdefault(c["flags"], []).append(got["samples_per_second"])
                        memory[c["flags"]] = got["memory"]
                    print(f"[{name} {repeat + 1}/{args.repeats}] {c['flags']}: {got}", flush=True)
            cache[name] = {"measured": measured, "memory": memory}
            args.cache.parent.mkdir(parents=True, exist_ok=True)
            args.cache.write_text(json.dumps(cache, indent=1))
            points += report(name, args, result, measured, memory)
            print(f"load after: {load()}\n", flush=True)
    return points


def report(
    name: str,
    args: argparse.Namespace,
    result: dict,
    measured: dict[str, list[float]],
    memory: dict[str, int],
) -> list[plan_plot.Point]:
    """Print the markdown table of `name`'s predictions against its measured runs; the
    points to plot."""
    predicted = {c["flags"]: [c["samples_per_second"]] for c in result["candidates"]}
    title = f"{name} on {args.hosts} hosts x 1 process, links at {args.rate}"
    print(table(title, result, predicted, measured, memory)[0], flush=True)
    return plan_plot.points_of(name, result, measured)


if __name__ == "__main__":
    main()
