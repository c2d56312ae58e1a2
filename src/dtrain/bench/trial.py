"""One trial of `dtrain bench`: what it runs (a bundled model through `dtrain demo`, or the
user's script through `dtrain run`), whether a layout can run at all, and running it once
as a subprocess under a time limit."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.bench import proctree
from dtrain.bench.bench_flags import DEFAULT_STEPS, entry_config, entry_parts, parse_hosts

GRACE_SECONDS = 20.0
"""How long a trial stopped for its time limit has to end its workers before they are
killed."""

# Variables of an enclosing launch that would make a trial's launcher think it is a worker.
_INHERITED = ("DTRAIN_CONFIG", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Workload:
    """What every trial runs; the flags besides the layout's are the same in all."""

    model: str | None
    """A bundled model trained by `dtrain demo`, or None with `script`."""
    script: Path | None = None
    """The user's script, run by `dtrain run`."""
    script_args: tuple[str, ...] = ()
    demo_flags: tuple[str, ...] = ()
    """`dtrain demo` flags of the model's training (size, batch, optimizer, steps)."""
    global_batch_size: int | None = None
    hosts: tuple[str, ...] = ()
    """Machines every trial runs on (its --nproc processes on each), over ssh; empty: this
    machine alone."""
    ssh_flags: tuple[str, ...] = ()
    """`--ssh-port`/`--ssh-identity` for the trials' launcher."""

    @property
    def machines(self) -> int:
        """How many machines each trial spans."""
        return max(1, len(self.hosts))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        """The workload the `dtrain bench` flags describe (default: the digits MLP)."""
        ssh = []
        if args.ssh_port is not None:
            ssh += ["--ssh-port", str(args.ssh_port)]
        if args.ssh_identity:
            ssh += ["--ssh-identity", args.ssh_identity]
        where = {"hosts": parse_hosts(args.hosts), "ssh_flags": tuple(ssh)}
        if args.script is not None:
            script_args = tuple(shlex.split(args.script_args))
            return cls(None, args.script.resolve(), script_args, **where)
        model = args.model or "mlp"
        flags = ["--model", model, "--steps", str(args.steps or DEFAULT_STEPS)]
        for flag, value in (
            ("--model-size", args.model_size),
            ("--experts", args.experts or None),
            ("--top-k", args.top_k if args.experts else None),
            ("--global-batch-size", args.global_batch_size),
            ("--optimizer", args.optimizer),
        ):
            if value is not None:
                flags += [flag, str(value)]
        return cls(
            model, demo_flags=tuple(flags), global_batch_size=args.global_batch_size, **where
        )

    @property
    def description(self) -> str:
        """What runs, in a few words, for the table's heading."""
        if self.script is not None:
            return f"script {self.script.name} " + " ".join(self.script_args)
        return "dtrain demo " + " ".join(self.demo_flags)

    def check(self, strategy: str, nproc: int) -> None:
        """Raise ConfigError if `strategy` cannot run on `nproc` processes per machine (with
        this model's global batch), as the launcher would before starting anything."""
        from dtrain.launcher.hosts import as_nodes, hosts_of
        from dtrain.strategies.specs import lookup

        config = entry_config(strategy, nproc, self._host_slots(nproc))
        machines = hosts_of(config)
        if machines is not None:
            config = as_nodes(config, machines)
        spec = lookup(config.strategy)
        spec.check_launch(config)
        spec.check_options(config)
        if self.model is None:
            return
        from dtrain.models.recipes import TASKS
        from dtrain.step.batches import check_batch

        dp_size, splits = spec.batch_layout(config)
        batch = self.global_batch_size or TASKS[self.model].global_batch_size
        check_batch(batch, dp_size, splits, config.grad_accumulation)

    def command(self, strategy: str, nproc: int, seed: int, scratch: Path) -> list[str]:
        """The `dtrain` command line of one trial; its metrics go to scratch/metrics.json
        and its outputs (checkpoints, logs) below `scratch`."""
        slots = self._host_slots(nproc)  # -H gives each machine its processes
        where = ["-H", ",".join(slots), *self.ssh_flags] if slots else ["--nproc", str(nproc)]
        name, flags = entry_parts(strategy)
        layout = [
            "--strategy", name, *flags, *where, "--seed", str(seed),
            "--memory-report", "--metrics-json", str(scratch / "metrics.json"),
            "--out", str(scratch / "out"),
        ]  # fmt: skip
        dtrain = [sys.executable, "-m", "dtrain.cli"]
        if self.script is None:
            return [*dtrain, "demo", *layout, *self.demo_flags]
        return [*dtrain, "run", *layout, str(self.script), *self.script_args]

    def _host_slots(self, nproc: int) -> list[str] | None:
        return [f"{host}:{nproc}" for host in self.hosts] or None


@dataclass
class TrialResult:
    """What one trial measured."""

    strategy: str
    nproc: int
    repeat: int
    status: str
    """ok, failed or timeout."""
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)
    """The trial's metrics JSON (empty when it wrote none)."""
    peak_rss_bytes: list[int | None] | None = None
    """Each rank's peak resident memory, seen from outside (None where /proc is missing)."""
    note: str = ""
    log: str = ""


def run_trial(
    workload: Workload,
    strategy: str,
    nproc: int,
    repeat: int,
    *,
    seed: int,
    timeout: float,
    log_path: Path,
) -> TrialResult:
    """Run one trial to its end or its time limit; never raises for the trial's own
    failure (the result says what happened and where its log is)."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["PYTHONUNBUFFERED"] = "1"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp, log_path.open("w") as log:
        scratch = Path(tmp)
        command = workload.command(strategy, nproc, seed, scratch)
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        watch = proctree.PeakMemory(proc.pid).start() if proctree.available() else None
        status = "ok"
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status, code = "timeout", _stop(proc, watch)
        except KeyboardInterrupt:
            # Ctrl-C reaches the bench alone (the trial runs in a session of its own).
            _stop(proc, watch)
            if watch is not None:
                watch.stop()
            raise
        seconds = time.perf_counter() - start
        peaks = watch.stop() if watch is not None else None
        metrics = _read_metrics(scratch / "metrics.json")
    result = TrialResult(
        strategy, nproc, repeat, status, seconds, metrics, peaks, log=str(log_path)
    )
    if status == "timeout":
        result.note = f"stopped after the --timeout of {timeout:g} s; see {log_path}"
    elif code != 0 or not metrics:
        result.status = "failed"
        why = f"exit code {code}" if code != 0 else "no metrics JSON written"
        result.note = f"{why}: {_last_line(log_path)} (log: {log_path})"
    return result


def _stop(proc: subprocess.Popen[bytes], watch: proctree.PeakMemory | None) -> int:
    """Ask the trial's launcher to stop (it ends its workers), then kill what is left."""
    tree = proctree.descendants(proc.pid) if proctree.available() else {}
    if watch is not None:
        tree = {**watch.seen, **tree}
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
    finally:
        proctree.kill_tree({pid: t for pid, t in tree.items() if pid != proc.pid})


def _read_metrics(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _last_line(path: Path) -> str:
    """The last non-empty line of a trial's log: usually the error that ended it."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith("$ ")]
    return lines[-1][:200] if lines else "no output"
