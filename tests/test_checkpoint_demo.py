"""The demo's checkpoints at world size 3, saved at every step and one kept: whether a step
is saved is decided once for every rank, and only the main rank deletes older
checkpoints, once the new one is complete (no rank scans the folder while it does)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout", [[], ["--checkpoint-format", "sharded", "--async-checkpoint"]], ids=str
)
def test_keeping_one_checkpoint_while_saving_every_step_at_world_3(
    tmp_path: Path, layout: list[str]
) -> None:
    out = tmp_path / "run"
    proc = run_cli(
        "demo",
        "--strategy",
        "ddp",
        "--nproc",
        "3",
        "--model",
        "mlp",
        "--global-batch-size",
        "48",
        "--steps",
        "8",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--timeout",
        "60",
        "--out",
        str(out),
        *layout,
        cwd=tmp_path,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000008"]
