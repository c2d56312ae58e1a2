"""What a torchrun user expects: `--nproc 2` alone means ddp, every world size sets
torchrun's variables, dtrain.init() runs under plain torchrun, and flags that would do
nothing are refused before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

import dtrain
from dtrain.errors import ConfigError

REPORT = """
import os
import torch.distributed as dist
import dtrain
engine = dtrain.init()
print(f"strategy {engine.strategy.name} world {engine.world_size}", flush=True)
engine.close()
"""

PLAIN_TORCH = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} of {dist.get_world_size()} {os.environ['MASTER_ADDR']}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_nproc_without_a_strategy_means_ddp_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text(REPORT)
    proc = run_cli("run", "--nproc", "2", "report.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("strategy ddp world 2") == 2
    assert "dtrain: strategy ddp (2 process(es); choose another with --strategy)" in proc.stderr


@pytest.mark.timeout(120)
def test_one_process_gets_torchruns_variables(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text(PLAIN_TORCH)
    proc = run_cli("run", "plain.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 of 1 127.0.0.1" in proc.stdout


@pytest.mark.timeout(120)
def test_dtrain_init_runs_under_plain_torchrun(tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text(REPORT)
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*command, "report.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("strategy ddp world 2") == 2
    env["DTRAIN_STRATEGY"] = "zero3"
    proc = subprocess.run(
        [*command, "report.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.stdout.count("strategy zero3 world 2") == 2, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "ddp", "towers": 2}, "--towers sets the replicas of --strategy towers"),
        ({"strategy": "ddp", "servers": 2}, "--servers configure parameter servers"),
        ({"strategy": "zero3", "ps_mode": "async"}, "--ps-mode configure parameter servers"),
        ({"master": "host:29500"}, "--master names node 0's rendezvous"),
    ],
)
def test_flags_that_would_do_nothing_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dtrain.Config(**options)


def test_gpu_only_flags_are_refused_before_any_process_starts(tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text(REPORT)
    flags = ["--strategy", "zero3", "--cpu-offload"]
    proc = run_cli("run", "--nproc", "2", "--cpu", *flags, "report.py", cwd=tmp_path)
    assert proc.returncode == 2 and "without GPUs there is nothing to offload" in proc.stderr
    assert "strategy" not in proc.stdout  # no worker started
