"""Shared fixtures: a small, real training job every equivalence test runs."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the `dtrain` command in a subprocess; return it with its output captured."""
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    """`dtrain ckpt ARGS` in this process, returned as `run_cli` returns a command. The
    ckpt commands only read and write files: starting Python and torch for each costs
    seconds (tests/test_cli.py runs them through the command line)."""
    from dtrain import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["ckpt", *args])
    command = ["dtrain", "ckpt", *args]
    return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())


@pytest.fixture(autouse=True)
def _no_inherited_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build their topology explicitly; none leaks in from the environment."""
    for name in ("DTRAIN_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `quick` every test without a timeout of its own: the multi-process and
    command-line tests all set one, so `pytest -m quick` is the in-process subset, a
    loop of a few minutes for working on the code."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.quick)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what the test modules imported (torch, dtrain, ...) out of every later
    garbage collection: it lives as long as the session, and a gc.collect() (the Engine's
    close runs one, so do the helpers that end a job) scanning it takes a quarter of a
    second; without it, microseconds."""
    gc.freeze()
