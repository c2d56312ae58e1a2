"""The launcher and its workers live and die together: SIGTERM stops the job with one
line and exit 143, SIGKILL of the launcher takes its workers with it, and a restart is
announced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

WAITS = """
import time
import dtrain
engine = dtrain.init()
engine.barrier()
print(f"ready {engine.rank}", flush=True)
time.sleep(120)
"""


def start_waiting_job(tmp_path: Path, name: str) -> subprocess.Popen[str]:
    """`dtrain run --strategy ddp --nproc 2` on a script that waits, once both ranks run."""
    script = tmp_path / name
    script.write_text(WAITS)
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "run", "--strategy", "ddp", "--nproc", "2", name],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = 0
    assert proc.stdout is not None
    while ready < 2:
        line = proc.stdout.readline()
        assert line, "the job ended before both ranks were ready"
        ready += line.count("ready")  # two ranks' unbuffered prints may share a line
    return proc


def workers_of(name: str) -> list[int]:
    """Pids of the worker processes running script `name`."""
    found = subprocess.run(["pgrep", "-f", f"bootstrap script {name}"], capture_output=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.mark.timeout(120)
def test_sigterm_stops_the_job_with_one_line_and_exit_143(tmp_path: Path) -> None:
    proc = start_waiting_job(tmp_path, "term.py")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM; every worker was stopped" in err
    assert "Traceback" not in err
    assert workers_of("term.py") == []


@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    proc = start_waiting_job(tmp_path, "orphan.py")
    assert len(workers_of("orphan.py")) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while workers_of("orphan.py") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers_of("orphan.py") == [], "workers outlived their launcher"


FLAKY = """
import dtrain
engine = dtrain.init()
engine.barrier()
if engine.restart_count == 0 and engine.rank == 1:
    raise RuntimeError("the first attempt fails on purpose")
"""


@pytest.mark.timeout(120)
def test_a_restart_is_announced(tmp_path: Path) -> None:
    (tmp_path / "flaky.py").write_text(FLAKY)
    proc = run_cli(
        "run", "--strategy", "ddp", "--nproc", "2", "--max-restarts", "1", "flaky.py", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "restarting it, attempt 2 of 2" in proc.stderr
