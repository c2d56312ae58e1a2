"""`dtrain demo` and `dtrain run` end to end, through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
from conftest import run_cli
from distributed import free_port
from torch.testing import assert_close
from training import train

from dtrain.models import build

pytestmark = pytest.mark.timeout(240)


def demo(tmp_path: Path, *flags: str, name: str = "run") -> dict:
    out = tmp_path / name
    proc = run_cli(
        "demo", *flags, "--out", str(out), "--metrics-json", str(out / "m.json"), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "m.json").read_text())


@pytest.mark.parametrize(
    "flags",
    [("--strategy", "towers"), ("--strategy", "ddp", "--nproc", "2")],
    ids=["towers", "ddp2"],
)
def test_demo_reaches_95_percent(tmp_path: Path, flags: tuple[str, ...]) -> None:
    metrics = demo(tmp_path, *flags)
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["steps"] == 12 * (1437 // 64)
    assert metrics["world_size"] == (2 if "ddp" in flags else 1)
    for key in ("strategy", "train_loss", "samples_per_second", "wall_seconds"):
        assert key in metrics
    assert (tmp_path / "run" / "logs" / "rank0.log").is_file()
    checkpoints = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step-00000220", "step-00000242", "step-00000264"]


def test_ddp_stop_and_resume_equals_uninterrupted(tmp_path: Path) -> None:
    common = ("--model", "mlp", "--epochs", "2", "--checkpoint-every", "10")
    demo(tmp_path, *common, name="whole")
    ddp = ("--strategy", "ddp", "--nproc", "2")
    demo(tmp_path, *common, *ddp, "--steps", "25", name="split")
    again = run_cli("demo", *common, "--out", str(tmp_path / "split"), cwd=tmp_path)
    assert again.returncode == 2 and "add --resume to continue it, --overwrite" in again.stderr
    resumed = demo(tmp_path, *common, *ddp, "--resume", name="split")
    assert resumed["steps"] == 44
    whole = safetensors.torch.load_file(
        tmp_path / "whole/checkpoints/step-00000044/model.safetensors"
    )
    split = safetensors.torch.load_file(
        tmp_path / "split/checkpoints/step-00000044/model.safetensors"
    )
    assert_close(split, whole)


def test_unknown_strategy_lists_the_known_ones(tmp_path: Path) -> None:
    proc = run_cli("demo", "--strategy", "magic", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Unknown strategy 'magic'. Known strategies: single, towers, ddp" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--strategy", "ddp", "--nproc", "3", "--global-batch-size", "64"),
            "does not divide evenly over 3 data-parallel workers",
        ),
        (
            ("--strategy", "ddp", "--nproc", "2", "--global-batch-size", "1"),
            "smaller than the 2 data-parallel workers",
        ),
        (
            ("--strategy", "towers", "--towers", "3", "--global-batch-size", "64"),
            "does not split evenly into 3 part(s)",
        ),
        (("--strategy", "single", "--nproc", "2"), "runs in one process"),
    ],
)
def test_bad_topologies_are_refused_before_launch(
    tmp_path: Path, flags: tuple, message: str
) -> None:
    proc = run_cli("demo", *flags, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_script_is_named(tmp_path: Path) -> None:
    proc = run_cli("run", "--strategy", "ddp", "--nproc", "2", "nope.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "The script nope.py does not exist" in proc.stderr


def test_a_non_finite_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "nan"
    proc = run_cli(
        "demo",
        "--model",
        "mlp",
        "--lr",
        "1e12",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "The loss is" in proc.stderr and "at step" in proc.stderr
    assert "Traceback" not in proc.stderr
    kept = sorted((out / "checkpoints").iterdir())
    assert kept, "the checkpoints written before the bad step must stay"
    assert run_cli("ckpt", "verify", str(kept[-1]), cwd=tmp_path).returncode == 0


FAILING_SCRIPT = """
import dtrain
engine = dtrain.init()

def compute(x):
    if engine.rank == 1:
        raise ValueError("bad batch on purpose")
    return x

engine.barrier()
compute(1)
engine.barrier()
"""


def run_on_two_ranks(tmp_path: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    """`dtrain run --strategy ddp --nproc 2` on a script holding `text`."""
    script = tmp_path / name
    script.write_text(text)
    return run_cli(
        "run",
        "--strategy",
        "ddp",
        "--nproc",
        "2",
        "--timeout",
        "30",
        str(script),
        cwd=tmp_path,
        timeout=120,
    )


def test_a_failing_rank_is_named_with_its_own_traceback(tmp_path: Path) -> None:
    proc = run_on_two_ranks(tmp_path, "fails.py", FAILING_SCRIPT)
    assert proc.returncode == 1
    assert "Rank 1 (local rank 1" in proc.stderr
    assert "exited with code 1" in proc.stderr
    assert 'fails.py", line 7, in compute' in proc.stderr
    assert "ValueError: bad batch on purpose" in proc.stderr
    assert "runpy" not in proc.stderr


def test_ckpt_inspect_describes_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000022"
    train(steps=22, checkpoint_out=str(ckpt), strategy="single")  # the digits MLP and SGD
    proc = run_cli("ckpt", "inspect", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("single", "step", "22", "SGD", "net.1.weight"):
        assert text in proc.stdout


KILLED_SCRIPT = """
import os, signal
import dtrain
engine = dtrain.init()
engine.barrier()
if engine.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
engine.barrier()
"""


def test_a_killed_rank_is_named_with_its_signal_and_nobody_hangs(tmp_path: Path) -> None:
    proc = run_on_two_ranks(tmp_path, "killed.py", KILLED_SCRIPT)
    assert proc.returncode == 1
    assert "Rank 1 (local rank 1" in proc.stderr
    assert "killed by signal SIGKILL" in proc.stderr


def test_two_nodes_on_one_machine_train_as_one_job(tmp_path: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    out = tmp_path / "nodes"
    common = [
        "demo",
        "--strategy",
        "ddp",
        "--nnodes",
        "2",
        "--master",
        master,
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--out",
        str(out),
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", *common, "--node-rank", "1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        node0 = run_cli(
            *common,
            "--node-rank",
            "0",
            "--metrics-json",
            str(out / "m.json"),
            cwd=tmp_path,
            timeout=180,
        )
        _, node1_err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert node1.returncode == 0, node1_err[-2000:]
    metrics = json.loads((out / "m.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 1437 // 64


def test_bf16_mixed_trains_the_digits_under_zero2(tmp_path: Path) -> None:
    metrics = demo(tmp_path, "--strategy", "zero2", "--nproc", "2", "--precision", "bf16-mixed")
    assert metrics["test_accuracy"] >= 0.95


def test_gpt_trains_under_zero3_and_reports_memory(tmp_path: Path) -> None:
    metrics = demo(
        tmp_path,
        "--model",
        "gpt",
        "--strategy",
        "zero3",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--memory-report",
    )
    assert metrics["test_perplexity"] < 40  # a uniform guess over bytes scores 256
    params = sum(p.numel() for p in build("gpt").parameters())
    memory = metrics["memory"]
    assert [row["rank"] for row in memory] == [0, 1]
    for row in memory:  # ZeRO-3, fp32 AdamW: 16 bytes per parameter over 2 ranks
        total = row["parameters"] + row["gradients"] + row["optimizer"]
        assert abs(total - 16 * params / 2) / (16 * params / 2) < 0.02
        # zero3 reshards every unit after forward: no gathered parameters between forward
        # and backward (zero2 keeps them, and reports all P there).
        assert row["parameters_in_step"] == row["parameters"]


def test_version_and_defaults_in_help(tmp_path: Path) -> None:
    version = run_cli("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("dtrain ")
    shown = run_cli("run", "--help", cwd=tmp_path).stdout
    assert "(default: 10)" in shown  # --log-every
    assert "(default: 600.0)" in shown  # --timeout
