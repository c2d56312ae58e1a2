"""Validate `dtrain plan`: run every candidate it lists and compare predicted with measured.

For each model, `dtrain plan --json` lists the candidates for --nproc processes on this
machine; each one then trains with `dtrain demo` under its own flags (the same model,
global batch and optimizer) for --steps steps with --metrics-json, and its measured
samples/s (the demo's, over every step) is set against the prediction. Repeats run the
candidates round-robin, so a change in the machine's load touches every candidate; the
figure kept is each candidate's median. Each repeat calibrates anew (`dtrain plan` just
before its runs), so the prediction and the measurement of a repeat see the same load of
a shared machine; the predicted figure kept is the median of the repeats'. Prints a
markdown table per model: predicted, measured, the error of each row, the median
absolute error, and whether the planner's first pick is within 5% of the best measured.

Memory: every run has `--memory-report`, which measures each rank's model states at the
first step (parameters, the larger of between steps and from forward to backward;
gradients; optimizer state). Each row sets the fullest rank's figure against the plan's
`model_state_bytes` (the same three, at the peak); the plan's `memory_bytes_per_rank`
adds what the report does not count (activations, DDP's buckets, the towers' copies).
The machine's load average is printed before and after the runs.

    python benchmarks/plan_validation.py --nproc 2 --repeats 2

Measured figures are cached in --cache (JSON, keyed by model and flags), so that a change
of the cost model can be checked against the same runs with --reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import plan_plot

MODELS = {
    "mlp": ["--model", "mlp"],
    "gpt-small": ["--model", "gpt", "--model-size", "small"],
}
STEPS = {"mlp": 1000, "gpt-small": 40}


def dtrain(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`dtrain ARGS` in a child process (its output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def plan(model: list[str], nproc: int) -> dict:
    """`dtrain plan --json` for `model` on `nproc` processes."""
    done = dtrain("plan", *model, "--nproc", str(nproc), "--json")
    if done.returncode:
        raise SystemExit(f"dtrain plan failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def measure(model: list[str], candidate: dict, steps: int, batch: int) -> dict | None:
    """samples/s and the fullest rank's model-state bytes of one `dtrain demo` run of
    `candidate`, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix="plan-validation-") as tmp:
        metrics = Path(tmp) / "metrics.json"
        args = [
            "demo", *model, *shlex.split(candidate["flags"]),
            "--optimizer", candidate["optimizer"], "--global-batch-size", str(batch),
            "--steps", str(steps), "--out", tmp, "--metrics-json", str(metrics),
            "--memory-report",
        ]  # fmt: skip
        done = dtrain(*args)
        if done.returncode or not metrics.exists():
            print(f"  failed: {candidate['flags']}\n{done.stderr[-1500:]}", file=sys.stderr)
            return None
        result = json.loads(metrics.read_text())
        return {
            "samples_per_second": float(result["samples_per_second"]),
            "memory": model_states(result.get("memory") or []),
        }


def model_states(ranks: list[dict]) -> int:
    """The fullest rank's model states as `--memory-report` counts them at their peak."""
    return max(
        (
            max(r.get("parameters", 0), r.get("parameters_in_step", 0))
            + r.get("gradients", 0)
            + r.get("optimizer", 0)
            for r in ranks
        ),
        default=0,
    )


def optimizer_of(result: dict) -> str:
    """The optimizer the plan assumed (from its demo command)."""
    command = result["candidates"][0].get("command", "")
    words = command.split()
    return words[words.index("--optimizer") + 1] if "--optimizer" in words else "sgd"


def table(
    name: str,
    result: dict,
    predicted: dict[str, list[float]],
    measured: dict[str, list[float]],
    memory: dict[str, int],
) -> tuple[str, float, bool]:
    """The markdown table of one model; (table, median |error|, first pick within 5%)."""
    rows, errors, memory_errors = [], [], []
    best = max((statistics.median(v) for v in measured.values() if v), default=0.0)
    for c in result["candidates"]:
        c["samples_per_second"] = statistics.median(
            predicted.get(c["flags"]) or [c["samples_per_second"]]
        )
    result["candidates"].sort(key=lambda c: -c["samples_per_second"])
    for i, c in enumerate(result["candidates"], 1):
        runs = measured.get(c["flags"], [])
        got = statistics.median(runs) if runs else None
        predicted_now = c["samples_per_second"]
        if got:
            error = predicted_now / got - 1
            errors.append(abs(error))
            shown = f"{got:,.0f} | {error:+.0%}"
        else:
            shown = "failed | -"
        states, reported = c["model_state_bytes"], memory.get(c["flags"])
        if reported:
            memory_errors.append(abs(states / reported - 1))
            held = f"{states / 2**20:,.3f} | {reported / 2**20:,.3f} | {states / reported - 1:+.1%}"
        else:
            held = f"{states / 2**20:,.3f} | - | -"
        rows.append(
            f"| {i} | `{c['flags']}` | {predicted_now:,.0f} | {shown} | {held} | "
            f"{c['memory_bytes_per_rank'] / 2**20:,.3f} |"
        )
    first = measured.get(result["candidates"][0]["flags"], [])
    first_ok = bool(first) and statistics.median(first) >= 0.95 * best
    median_error = statistics.median(errors) if errors else float("nan")
    head = (
        f"{name}, global batch {result['global_batch_size']}:\n\n"
        "| rank | flags | predicted samples/s | measured samples/s | error | "
        "model states MiB, predicted | measured | error | all MiB/rank, predicted |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    foot = (
        f"\nMedian |error| {median_error:.0%}; first pick measured "
        f"{statistics.median(first) if first else 0:,.0f} against the best measured "
        f"{best:,.0f}: {'within' if first_ok else 'not within'} 5%."
    )
    if memory_errors:
        within = sum(e <= 0.10 for e in memory_errors)
        foot += (
            f" Model states: median |error| {statistics.median(memory_errors):.1%}, "
            f"{within} of {len(memory_errors)} rows within 10%."
        )
    return "\n".join([head, *rows, foot]), median_error, first_ok


def load() -> str:
    """This machine's load average, as `uptime` shows it."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help="mlp, gpt-small")
    parser.add_argument(
        "--steps", type=int, default=None, help="Steps per run (default: mlp 1000, gpt-small 40)."
    )
    parser.add_argument("--cache", type=Path, default=Path("runs/plan_validation.json"))
    parser.add_argument(
        "--reuse", action="store_true", help="Use the cached measurements, run nothing."
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="Also draw predicted against measured (PNG)."
    )
    args = parser.parse_args()
    points: list[plan_plot.Point] = []
    print(f"load average (1, 5, 15 min) at the start: {load()}", flush=True)
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    for name in args.models.split(","):
        model = MODELS[name]
        entry = cache.setdefault(name, {"measured": {}, "predicted": {}})
        measured: dict[str, list[float]] = entry["measured"]
        predicted: dict[str, list[float]] = entry["predicted"]
        memory: dict[str, int] = entry.setdefault("memory", {})
        result = plan(model, args.nproc)
        if not args.reuse:
            measured.clear()
            predicted.clear()
            memory.clear()
            for r in range(args.repeats):
                if r:
                    result = plan(model, args.nproc)
                optimizer = optimizer_of(result)
                for c in result["candidates"]:
                    predicted.setdefault(c["flags"], []).append(c["samples_per_second"])
                for c in result["candidates"]:
                    steps = args.steps or STEPS[name]
                    got = measure(model, {**c, "optimizer": optimizer}, steps,
                                  result["global_batch_size"])  # fmt: skip
                    if got is not None:
                        measured.setdefault(c["flags"], []).append(got["samples_per_second"])
                        memory[c["flags"]] = got["memory"]
                    print(f"[{name} {r + 1}/{args.repeats}] {c['flags']}: {got}", flush=True)
                args.cache.parent.mkdir(parents=True, exist_ok=True)
                args.cache.write_text(json.dumps(cache, indent=1))
        else:
            predicted.clear()  # the model changed: predict anew, against the same runs
        text, _, _ = table(name, result, predicted, measured, memory)
        print(text + "\n", flush=True)
        print(f"load average (1, 5, 15 min) after {name}: {load()}", flush=True)
        points += plan_plot.points_of(name, result, measured)
    if args.plot and points:
        plan_plot.draw(points, args.plot, f"dtrain plan on {args.nproc} processes, this machine")


if __name__ == "__main__":
    main()
