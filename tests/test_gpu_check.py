"""The GPU check (benchmarks/gpu_check.py) keeps working between the sessions lent a GPU.

Its CPU half runs here in CI (a few cases and the Horovod probe, on gloo), so that a
session that gets a GPU finds a script that runs; its GPU half, every case, is marked
`gpu` and skipped where no GPU is visible (`pytest -m gpu` on a GPU machine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _check(*args: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "check"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(300)
def test_the_cpu_half_runs_and_prints_its_table(tmp_path: Path) -> None:
    done = _check("--cpu", "--only", "zero3,horovod", tmp_path=tmp_path, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("gpu_check on CPU", 1)[1]
    lines = {line.split()[0]: line.split()[1] for line in table.splitlines()[3:] if line.strip()}
    assert lines == {"single": "ok", "zero3": "ok", "horovod-np1": "ok"}


def test_an_unknown_case_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    done = _check("--cpu", "--only", "zero4", tmp_path=tmp_path, timeout=60)
    assert done.returncode == 2
    assert "unknown case(s) ['zero4']" in done.stderr and "zero3" in done.stderr


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_every_case_passes_on_the_gpu(tmp_path: Path) -> None:
    done = _check(tmp_path=tmp_path, timeout=580)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
