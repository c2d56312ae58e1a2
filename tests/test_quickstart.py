"""The README's quickstart is examples/quickstart.py, word for word, and it runs as the
README says: with plain python (one device) and under `dtrain run --strategy ddp`, where it
trains the same model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
from conftest import run_cli
from torch.testing import assert_close

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"
FIRST_EPOCH = Path("runs", "quickstart", "epoch-0", "model.safetensors")
"""Where the script saves the model after its first epoch, under its working directory."""


def test_the_readme_quickstart_is_the_example_file() -> None:
    block = f"```python\n{QUICKSTART.read_text()}```\n"
    assert block in (ROOT / "README.md").read_text(), (
        "README.md's quickstart block differs from examples/quickstart.py; paste the file "
        "into the README (or the README's block into the file)."
    )


@pytest.mark.timeout(120)
def test_the_quickstart_runs_alone_and_under_ddp_training_the_same_model(
    tmp_path: Path,
) -> None:
    alone, ddp = tmp_path / "python", tmp_path / "ddp"
    alone.mkdir()
    ddp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    plain = subprocess.run(
        [sys.executable, str(QUICKSTART), "--epochs", "1"],
        cwd=alone,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert plain.returncode == 0, plain.stderr
    assert "test: {" in plain.stdout and "'accuracy'" in plain.stdout
    launched = run_cli(
        "run", "--strategy", "ddp", "--nproc", "2", str(QUICKSTART), "--epochs", "1", cwd=ddp
    )
    assert launched.returncode == 0, launched.stderr
    assert "test: {" in launched.stdout
    assert_close(
        safetensors.torch.load_file(ddp / FIRST_EPOCH),
        safetensors.torch.load_file(alone / FIRST_EPOCH),
    )
