"""Parameter-server strategy, multi-process: sync equals single-process training, backup
workers, checkpoints across strategies, async and ssp on the demo, a killed worker."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_cli
from distributed import run_ranks
from step_files import step_files, too_many
from torch.testing import assert_close
from training import train

from dtrain.config import Config
from dtrain.process.topology import init_process_group
from dtrain.strategies.ps import serving
from dtrain.strategies.specs import lookup

SERVER = "server"
CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


def ps_config(options: dict[str, Any]) -> Config:
    """The Config the launcher would give every rank of a ps job run with `options`."""
    return Config(strategy="ps", **{k: v for k, v in options.items() if k in CONFIG_FIELDS})


def ps_rank(worker: Callable[[], Any], options: dict[str, Any]) -> Any:
    """`worker()` on a worker rank; on a server rank, what the launcher runs there
    (`role_main`), returning SERVER once it has ended normally."""
    role = lookup("ps").role_main(ps_config(options), int(os.environ["RANK"]))
    if role is None:
        return worker()
    role()
    return SERVER


def ps_train(**options: Any) -> Any:
    """`train` under ps on a worker; a server serves (as the launcher has it) and returns
    SERVER once every worker has finished."""
    return ps_rank(functools.partial(train, strategy="ps", **options), options)


def run_ps(workers: int, servers: int, **options: Any) -> list[Any]:
    """`ps_train` on `workers` + `servers` ranks; check the servers ended; workers' results."""
    fn = functools.partial(ps_train, nproc=workers, servers=servers, **options)
    results = run_ranks(fn, workers + servers, timeout=90)
    assert results[workers:] == [SERVER] * servers
    return results[:workers]


def ps_runs(
    worker: Callable[..., Any], runs: list[dict[str, Any]], workers: int, servers: int
) -> Any:
    """One rank of a ps job running each of `runs` (options) in turn: a worker returns
    ``worker(close=..., strategy="ps", nproc=workers, servers=servers, **run)`` per run
    (closing after the last), a server serves every run, one after another under that
    run's options (as the launcher has it), and returns SERVER."""
    layout = {"nproc": workers, "servers": servers}
    config = ps_config(layout)
    if lookup("ps").role_main(config, int(os.environ["RANK"])) is None:
        last = len(runs) - 1
        return [
            worker(close=i == last, strategy="ps", **layout, **run) for i, run in enumerate(runs)
        ]
    init_process_group(serving.topology(config, server=True), config.timeout_s)
    for run in runs:
        serving.serve_job(ps_config({**layout, **run}))
    dist.destroy_process_group()
    return SERVER


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process parameters after 10 steps on the global batch."""
    return train(strategy="single")


SCHEDULED = {"steps": 3, "scheduler": True}
"""The digits MLP under SGD with momentum, its learning rate halved every step by a
scheduler built before `engine.setup`. (Not Adam: with three workers the servers' mean
rounds otherwise than one sum, and Adam turns that into steps of its learning rate where
a gradient is near zero.)"""


def train_or_count(close: bool, count_files: bool = False, **options: Any) -> Any:
    """`train` under `options`, or with `count_files` the worker's `step_files`."""
    if count_files:
        return step_files(close=close, **options)
    return train(close=close, **options)


@pytest.fixture(scope="module")
def three_and_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    """One job of 3 workers and 2 servers running, in turn: 10 steps saved at the end;
    10 steps by hand from single's checkpoint after 10 steps; `SCHEDULED`; the files a
    worker's step opens. Returns worker 0's parameters of each run (its files for the
    last) and the folder of both checkpoints."""
    root = tmp_path_factory.mktemp("ps")
    train(steps=10, strategy="single", checkpoint_out=str(root / "single-10"))
    runs = [
        {"checkpoint_out": str(root / "ps-10")},
        {"steps": 10, "checkpoint_in": str(root / "single-10"), "manual": True},
        SCHEDULED,
        {"count_files": True, "gpt": True},
    ]
    results = run_ranks(ps_runs, 5, train_or_count, runs, 3, 2, timeout=140)
    assert results[3:] == [SERVER] * 2
    return results[0], root


@pytest.mark.timeout(150)
def test_sync_ps_matches_single_with_three_workers_and_two_servers(
    reference: dict, three_and_two: tuple[list[Any], Path]
) -> None:
    """Two workers and one server: the habits matrix (tests/test_habits.py)."""
    assert_close(three_and_two[0][0], reference)


@pytest.mark.timeout(150)
def test_a_worker_step_opens_the_files_of_the_parameter_server_client_only(
    three_and_two: tuple[list[Any], Path],
) -> None:
    found = three_and_two[0][3]
    assert found.keys() == {"train_step", "hand"}
    assert not too_many("ps", found), found


@pytest.mark.timeout(120)
def test_backup_workers_each_update_uses_w_minus_b_gradients() -> None:
    results = run_ps(3, 1, backup_workers=1, with_report=True)
    _, report = results[0]
    updates, used = report["ps_updates"][0], report["ps_gradients_used"][0]
    assert report["ps_gradients_per_update"] == [2, 2]
    assert updates > 0 and used == 2 * updates
    counted = used + report["ps_dropped_gradients"] + report["ps_pending_gradients"]
    assert counted == 3 * 10  # every commit of the 3 workers x 10 steps, once


@pytest.mark.timeout(150)
def test_checkpoints_cross_between_ps_and_single(three_and_two: tuple[list[Any], Path]) -> None:
    """ps (3 workers, 2 servers) saves after 10 steps; single continues from it; then ps
    (steps by hand) continues from a single checkpoint: both equal 20 uninterrupted single
    steps, so parameters and momentum crossed over intact."""
    (_, from_single, *_), root = three_and_two
    twenty = train(steps=20, strategy="single")
    manifest = json.loads((root / "ps-10" / "manifest.json").read_text())
    assert (manifest["strategy"], manifest["world_size"], manifest["step"]) == ("ps", 5, 10)
    assert_close(train(steps=10, strategy="single", checkpoint_in=str(root / "ps-10")), twenty)
    assert_close(from_single, twenty)


def demo(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "run"
    proc = run_cli(
        "demo",
        "--strategy",
        "ps",
        "--servers",
        "1",
        "--nproc",
        "2",
        *flags,
        "--out",
        str(out),
        "--metrics-json",
        str(out / "m.json"),
        cwd=tmp_path,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "m.json").read_text())


@pytest.mark.timeout(180)
def test_async_demo_reaches_95_percent(tmp_path: Path) -> None:
    # Stale gradients slow async down, the more so on a loaded machine: a few more epochs
    # than the demo's default keep the bar above 95% there too. At momentum 0.9 a run of
    # gradients 2 or more updates stale can kill every ReLU (the net then answers one
    # class: 10%, seen once on a loaded CI machine under ssp); the staleness-aware rate
    # prevents that even at a constant staleness of 3 (docs/strategies.md). 16 epochs
    # ended at 94.4% once in a full local suite; 20 gave 96.9-98.3% under 6 runs at once.
    metrics = demo(tmp_path, "--ps-mode", "async", "--staleness-aware-lr", "--epochs", "20")
    assert metrics["test_accuracy"] >= 0.95, metrics
    assert metrics["ps_updates"] == [2 * metrics["steps"]]  # one update per push
    assert metrics["ps_gradients_per_update"] == [1, 1]


@pytest.mark.timeout(180)
def test_ssp_demo_reaches_95_percent_and_keeps_the_step_gap(tmp_path: Path) -> None:
    # As for async (it reached 92% in 12 epochs once, and 10% without the
    # staleness-aware rate once).
    metrics = demo(
        tmp_path, "--ps-mode", "ssp", "--staleness", "1", "--staleness-aware-lr", "--epochs", "20"
    )
    assert metrics["test_accuracy"] >= 0.95, metrics
    assert 0 <= metrics["ps_max_step_gap"] <= 1


KILLED_WORKER = """
import os, signal
import torch, torch.nn.functional as F
import dtrain
from dtrain.models.digits import DigitsMLP
open(f"ran-{os.environ['RANK']}", "w").close()
engine = dtrain.init()
model = DigitsMLP(hidden=16)
model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
x, y = torch.rand(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)
for step in range(1000):
    if engine.rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    engine.train_step((x, y), F.cross_entropy)
engine.close()
"""


@pytest.mark.timeout(120)
def test_a_killed_worker_stops_the_job_with_its_role_named(tmp_path: Path) -> None:
    """Also: the launcher runs the server without the user's script (no ran-2 marker)."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_WORKER)
    start = time.monotonic()
    proc = run_cli(
        "run",
        "--strategy",
        "ps",
        "--nproc",
        "2",
        "--servers",
        "1",
        "--timeout",
        "20",
        str(script),
        cwd=tmp_path,
        timeout=100,
    )
    assert proc.returncode == 1
    assert "Rank 1 (worker 1, local rank 1" in proc.stderr
    assert "killed by signal SIGKILL" in proc.stderr
    assert time.monotonic() - start < 60
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == ["ran-0", "ran-1"]


@pytest.mark.timeout(150)
def test_a_scheduler_built_before_setup_drives_the_servers(
    three_and_two: tuple[list[Any], Path],
) -> None:
    expected = train(strategy="single", **SCHEDULED)
    unscheduled = train(strategy="single", steps=SCHEDULED["steps"])
    assert any(not torch.allclose(expected[k], unscheduled[k]) for k in expected), "no effect"
    assert_close(three_and_two[0][2], expected)
