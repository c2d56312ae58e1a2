"""The GPU check: every strategy that runs on one GPU, its options, and one table.

    python benchmarks/gpu_check.py                 # on a machine with a GPU (< 8 minutes)
    python benchmarks/gpu_check.py --cpu --only single,ddp,zero3   # the CPU half (CI)

Each case is a `dtrain demo` run (the GPT of the demo, a fixed seed, a fixed number of
steps) in a process of its own, so that a crash or a hang in one case is a row of the
table, not the end of the check. A case passes when it exits 0, its metrics JSON holds a
finite loss, and that loss matches the case it is compared with (the same model and data
under `single`, in the same precision) within the case's tolerance: at one process every
strategy computes the same step, so the losses differ only by the order of reductions.
Probes run beside the demos: Horovod's API on NCCL at one process (`horovodrun -np 1`
over examples/horovod_digits.py), the memory report against what the allocator saw, and
(on a GPU) the GPU's utilisation in the metrics, where NVML can be read.

The last lines printed are the table (case, status, loss, difference, samples/s, peak
memory, seconds); `--out DIR` keeps each case's log and metrics JSON. The exit status is
1 when any case failed, so `pytest -m gpu` (tests/test_gpu_check.py) can run it too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30
DEMO = (
    f"--model gpt --model-size tiny --steps {STEPS} --seed 0 --global-batch-size 32 "
    "--optimizer adamw --lr 0.001 --log-every 10"
).split()


@dataclass(frozen=True)
class Case:
    """One `dtrain demo` run: its flags, the case whose loss it must match, and how close."""

    name: str
    flags: list[str]
    reference: str | None = None
    rtol: float = 1e-3
    gpu_only: bool = False
    timeout_s: int = 150
    expect_refusal: str | None = None
    """A run that must fail before training, with this text in its output."""


@dataclass
class Row:
    """What one case gave."""

    name: str
    status: str
    loss: float | None = None
    diff: float | None = None
    samples_per_s: float | None = None
    peak_mib: float | None = None
    seconds: float = 0.0
    detail: str = ""
    metrics: dict = field(default_factory=dict)


BF16 = ["--precision", "bf16-mixed"]
FP16 = ["--precision", "fp16-mixed"]
AC = ["--activation-checkpointing", "full"]
CASES = [
    Case("single", ["--strategy", "single"]),
    Case("towers", ["--strategy", "towers"], "single"),
    Case("ddp", ["--strategy", "ddp", "--nproc", "1"], "single"),
    Case("zero1", ["--strategy", "zero1", "--nproc", "1"], "single"),
    Case("zero2", ["--strategy", "zero2", "--nproc", "1"], "single"),
    Case("zero3", ["--strategy", "zero3", "--nproc", "1"], "single"),
    Case("pipeline", ["--strategy", "pipeline", "--nproc", "1"], "single"),
    Case("tensor", ["--strategy", "tensor", "--nproc", "1"], "single"),
    Case("ps", ["--strategy", "ps", "--nproc", "1"], "single"),
    Case("single-bf16", ["--strategy", "single", *BF16]),
    Case("ddp-bf16", ["--strategy", "ddp", "--nproc", "1", *BF16], "single-bf16", 2e-2),
    Case("zero3-bf16", ["--strategy", "zero3", "--nproc", "1", *BF16], "single-bf16", 2e-2),
    Case("tensor-bf16", ["--strategy", "tensor", "--nproc", "1", *BF16], "single-bf16", 2e-2),
    Case(
        "zero3-offload",
        ["--strategy", "zero3", "--nproc", "1", "--cpu-offload"],
        "single",
        gpu_only=True,
    ),
    Case("single-compile", ["--strategy", "single", "--compile"], "single", 1e-2, timeout_s=200),
    Case(
        "zero3-compile",
        ["--strategy", "zero3", "--nproc", "1", "--compile"],
        "single",
        1e-2,
        timeout_s=200,
    ),
    Case("single-fp16", ["--strategy", "single", *FP16]),
    Case("ddp-fp16", ["--strategy", "ddp", "--nproc", "1", *FP16], "single-fp16", 2e-2),
    Case("zero3-fp16", ["--strategy", "zero3", "--nproc", "1", *FP16], "single-fp16", 2e-2),
    Case("tensor-fp16", ["--strategy", "tensor", "--nproc", "1", *FP16], "single-fp16", 2e-2),
    Case(
        "zero3-offload-fp16",
        ["--strategy", "zero3", "--nproc", "1", "--cpu-offload", *FP16],
        "single-fp16",
        2e-2,
        gpu_only=True,
    ),
    Case("single-ac", ["--strategy", "single", *AC], "single"),
    Case("zero3-ac", ["--strategy", "zero3", "--nproc", "1", *AC], "single"),
    Case("pipeline-ac", ["--strategy", "pipeline", "--nproc", "1", *AC], "single"),
    Case(
        "ddp-2-on-1-gpu",
        ["--strategy", "ddp", "--nproc", "2"],
        gpu_only=True,
        expect_refusal="visible GPU",
    ),
]


def run_case(case: Case, out: Path, cpu: bool) -> Row:
    """Run one case in its own process; read its metrics JSON."""
    folder = out / case.name
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.json"
    command = [
        sys.executable,
        "-m",
        "dtrain.cli",
        "demo",
        *DEMO,
        *case.flags,
        "--out",
        str(folder / "run"),
        "--overwrite",
        "--metrics-json",
        str(metrics),
        "--memory-report",
    ]
    if cpu:
        command.append("--cpu")
    log, code, seconds = _run(command, _env(), case.timeout_s, folder / "log.txt")
    if code is None:
        return Row(case.name, "HUNG", seconds=seconds, detail=f"no exit within {case.timeout_s} s")
    if case.expect_refusal is not None:
        refused = code != 0 and case.expect_refusal in log
        return Row(
            case.name,
            "ok" if refused else "FAIL",
            seconds=seconds,
            detail="refused by name" if refused else _last_line(log),
        )
    if code != 0 or not metrics.is_file():
        return Row(case.name, "FAIL", seconds=seconds, detail=_last_line(log))
    data = json.loads(metrics.read_text())
    peaks = data.get("peak_memory_bytes") or [0]
    row = Row(
        case.name,
        "ok",
        data.get("train_loss"),
        None,
        data.get("samples_per_second"),
        max(peaks) / 2**20,
        seconds,
        metrics=data,
    )
    if row.loss is None or not math.isfinite(row.loss):
        row.status, row.detail = "FAIL", f"loss {row.loss}"
    elif not data.get("breakdown"):
        row.status, row.detail = "FAIL", "no step-time breakdown in the metrics"
    return row


def _run(
    command: list[str], env: dict[str, str], timeout_s: int, log_file: Path
) -> tuple[str, int | None, float]:
    """Run `command` from the checkout's root, its output kept in `log_file`; return (its
    output, its exit code or None if it outlived `timeout_s`, seconds taken)."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        log = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log_file.write_text(log)
        return log, None, time.monotonic() - start
    log = done.stdout + done.stderr
    log_file.write_text(" ".join(command) + "\n" + log)
    return log, done.returncode, time.monotonic() - start


def _env() -> dict[str, str]:
    """The environment of a case: this checkout's dtrain first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _last_line(log: str) -> str:
    """The last non-empty line of a log: usually the error that ended the run."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


def compare(rows: dict[str, Row], cases: list[Case]) -> None:
    """Mark each case whose loss strays from its reference's by more than its tolerance."""
    for case in cases:
        row = rows.get(case.name)
        ref = rows.get(case.reference) if case.reference else None
        if row is None or row.status != "ok" or row.loss is None or ref is None:
            continue
        if ref.loss is None:
            continue
        row.diff = abs(row.loss - ref.loss) / max(abs(ref.loss), 1e-12)
        if row.diff > case.rtol:
            row.status = "DIFF"
            row.detail = f"loss {row.loss:.6f}, {case.reference} {ref.loss:.6f}"


def memory_probe(rows: dict[str, Row]) -> Row:
    """The memory report (parameters, gradients, optimizer state the strategy holds) must
    fit inside what the allocator reserved at its peak: a report above it counts wrong."""
    row = rows.get("single")
    if row is None or row.status != "ok":
        return Row("memory-report", "SKIP", detail="single did not run")
    report = row.metrics.get("memory") or []
    if not report:
        return Row("memory-report", "FAIL", detail="no memory report in the metrics")
    held = report[0]
    total = held["parameters"] + held["gradients"] + held["optimizer"]
    peak = max(row.metrics.get("peak_memory_bytes") or [0])
    ok = 0 < total <= peak
    return Row(
        "memory-report",
        "ok" if ok else "FAIL",
        peak_mib=peak / 2**20,
        detail=f"report {total / 2**20:.1f} MiB, allocator peak {peak / 2**20:.1f} MiB",
    )


def gpu_use_probe(rows: dict[str, Row]) -> Row:
    """What `watch nvidia-smi` shows, measured by dtrain: the single run's metrics must
    hold its GPU's utilisation (NVML), where this machine can read it."""
    from dtrain.observe.gpu_use import nvml_reader

    row = rows.get("single")
    if row is None or row.status != "ok":
        return Row("gpu-use", "SKIP", detail="single did not run")
    if nvml_reader() is None:
        return Row("gpu-use", "SKIP", detail="NVML unreadable (pip install nvidia-ml-py)")
    busy = row.metrics.get("gpu_busy_percent") or []
    ok = bool(busy) and busy[0] is not None and all(0 <= p <= 100 for p in busy[0].values())
    return Row("gpu-use", "ok" if ok else "FAIL", detail=f"gpu_busy_percent {busy}")


def horovod_probe(out: Path, cpu: bool) -> Row:
    """Horovod's API at one process (NCCL on a GPU): examples/horovod_digits.py for one
    epoch under `horovodrun -np 1`, which must end with an accuracy line."""
    env = _env()
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable,
        "-m",
        "dtrain.horovod.run",
        "-np",
        "1",
        sys.executable,
        "examples/horovod_digits.py",
        "--epochs",
        "2",
    ]
    log, code, seconds = _run(command, env, 150, out / "horovod.log")
    if code is None:
        return Row("horovod-np1", "HUNG", seconds=seconds, detail="no exit within 150 s")
    ok = code == 0 and "accuracy" in log.lower()
    return Row(
        "horovod-np1", "ok" if ok else "FAIL", seconds=seconds, detail="" if ok else _last_line(log)
    )


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width table."""
    head = (
        f"{'case':<16} {'status':<6} {'loss':>9} {'rel diff':>9} {'samples/s':>10} "
        f"{'peak MiB':>9} {'s':>6}  detail"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        loss = f"{r.loss:.5f}" if r.loss is not None else "-"
        diff = f"{r.diff:.1e}" if r.diff is not None else "-"
        sps = f"{r.samples_per_s:,.0f}" if r.samples_per_s else "-"
        peak = f"{r.peak_mib:,.0f}" if r.peak_mib else "-"
        lines.append(
            f"{r.name:<16} {r.status:<6} {loss:>9} {diff:>9} {sps:>10} {peak:>9} "
            f"{r.seconds:>6.1f}  {r.detail}"
        )
    return "\n".join(lines)


def machine(cpu: bool) -> str:
    """The device and software the check ran on, for the record."""
    import torch

    gpu = not cpu and torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    return f"{device}, torch {torch.__version__}, Python {sys.version.split()[0]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the cases on the CPU (gloo)")
    parser.add_argument("--only", help="comma-separated case names (and references they need)")
    parser.add_argument("--out", type=Path, help="keep each case's log and metrics here")
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no GPU is visible; pass --cpu to run the CPU half.", file=sys.stderr)
        return 2
    cases = [c for c in CASES if not (args.cpu and c.gpu_only)]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in CASES} - {"horovod", "memory"}
        if unknown:
            parser.error(f"unknown case(s) {sorted(unknown)}; known: {[c.name for c in CASES]}")
        wanted |= {c.reference for c in cases if c.name in wanted and c.reference}
        cases = [c for c in cases if c.name in wanted]
    else:
        wanted = {"horovod", "memory"}
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Row] = {}
    for case in cases:
        rows[case.name] = run_case(case, out, args.cpu)
        r = rows[case.name]
        print(f"gpu_check: {case.name}: {r.status} in {r.seconds:.1f} s {r.detail}", flush=True)
    compare(rows, cases)
    extra = []
    if "memory" in wanted and "single" in rows:
        extra.append(memory_probe(rows))
    if "single" in rows and not args.cpu:
        extra.append(gpu_use_probe(rows))
    if "horovod" in wanted:
        extra.append(horovod_probe(out, args.cpu))
    every = [*rows.values(), *extra]
    (out / "table.json").write_text(
        json.dumps([{k: v for k, v in vars(r).items() if k != "metrics"} for r in every], indent=1)
    )
    print(
        f"\ngpu_check on {machine(args.cpu)}; {STEPS} steps of the demo GPT (tiny), logs in {out}"
    )
    print(table(every))
    return 0 if all(r.status in ("ok", "SKIP") for r in every) else 1


if __name__ == "__main__":
    sys.exit(main())
