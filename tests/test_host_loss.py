"""An elastic job (--nnodes 1:2 --max-restarts 1) loses a machine mid-run.

Two `dtrain demo` jobs run at once on the same two test hosts (tests/cluster.py), with
one shared --out each (as on a shared file system): job "loss" has its rendezvous on
dt-h1, job "master" on dt-h2. Killing dt-h2 outright (every process on it) takes one
machine from the first job, which goes on alone from its last checkpoint with the same
global batch and ends with the parameters of an uninterrupted one-process run; and it
takes the rendezvous host from the second, whose machine left on dt-h1 says so and stops
within --timeout.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import cluster
import pytest
import safetensors.torch
from torch.testing import assert_close

from dtrain.errors import ConfigError

WHY_NOT = cluster.unavailable()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}"),
    pytest.mark.timeout(240),
]

STEPS = 80  # enough that "loss" is still running when "master" has started training
KILL_AFTER = {"loss": 4, "master": 1}  # the steps each job has saved before the kill
TIMEOUT_S = 10
DEMO = ("demo", "--model", "mlp", "--checkpoint-every", "1", "--seed", "0")


@pytest.fixture(scope="module")
def hosts() -> Iterator[cluster.Cluster]:
    """Two test hosts, dt-h1 and dt-h2."""
    with cluster.cluster(2, rate="1gbit") as made:
        yield made


def _checkpoint(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def _reached(out: Path, step: int) -> bool:
    """Whether a checkpoint of `step` or later is on disk (older ones are deleted)."""
    folder = out / "checkpoints"
    steps = [int(p.name[5:]) for p in folder.glob("step-*")] if folder.is_dir() else []
    return max(steps, default=-1) >= step


def _wait_for(
    what: str, ready: Callable[[], bool], procs: list[subprocess.Popen[str]], limit_s: float
) -> float:
    """Poll `ready()` until it is true (returning the time), failing if a process ended
    first or `limit_s` passed."""
    deadline = time.monotonic() + limit_s
    while not ready():
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended, f"{ended} ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.02)
    return time.monotonic()


def test_a_killed_host_is_survived_and_a_dead_rendezvous_host_is_named(
    hosts: cluster.Cluster, tmp_path: Path
) -> None:
    h1, h2 = hosts.hosts
    outs = {job: tmp_path / job for job in ("loss", "master", "single")}
    logs = {name: tmp_path / f"{name}.log" for name in ("loss-h1", "master-h1", "single")}
    elastic = ("--nnodes", "1:2", "--max-restarts", "1", "--timeout", str(TIMEOUT_S))
    jobs = {
        # job: (--master, --steps)
        "loss": ("dt-h1:29701", STEPS),
        "master": ("dt-h2:29702", 100_000),  # runs until its rendezvous host dies
    }
    procs: dict[str, subprocess.Popen[str]] = {}
    for job, (master, steps) in jobs.items():
        for host in (h1, h2):
            log = logs.get(f"{job}-{host.name[-2:]}")
            procs[f"{job}-{host.name[-2:]}"] = hosts.popen(
                host,
                cluster.dtrain_command(*DEMO, "--steps", str(steps), *elastic, "--master", master,
                         "--out", str(outs[job])),
                cwd=tmp_path,
                env=cluster.job_env(),
                stdout=log.open("w") if log else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
    # The uninterrupted reference, one process, alongside (it has the CPU while the
    # elastic jobs wait on their rendezvous).
    single = subprocess.Popen(
        cluster.dtrain_command(*DEMO, "--steps", str(STEPS), "--out", str(outs["single"])),
        cwd=tmp_path,
        env=cluster.job_env(),
        stdout=logs["single"].open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(
            f"the steps {KILL_AFTER}",
            lambda: all(_reached(outs[j], step) for j, step in KILL_AFTER.items()),
            list(procs.values()),
            limit_s=120,
        )
        killed = time.monotonic()
        hosts.kill(h2)
        noticed = _wait_for(
            "restart after the kill",
            lambda: "restarting it" in logs["loss-h1"].read_text(),
            [procs["loss-h1"]],
            limit_s=60,
        )
        procs["master-h1"].wait(timeout=TIMEOUT_S + 30)
        master_ended = time.monotonic()
        procs["loss-h1"].wait(timeout=120)
        single.wait(timeout=120)
    finally:
        single.kill()
    loss_log, master_log = logs["loss-h1"].read_text(), logs["master-h1"].read_text()
    assert procs["loss-h1"].returncode == 0, loss_log[-3000:]
    assert single.returncode == 0, logs["single"].read_text()[-3000:]
    # The survivor noticed, met again alone and went on from a checkpoint before the end.
    assert noticed - killed < TIMEOUT_S, loss_log[-3000:]
    assert "global batch 64 (64 per worker)" in loss_log, loss_log[-3000:]
    resumed = int(loss_log.split("Resumed at step ")[1].split()[0])
    assert KILL_AFTER["loss"] <= resumed < STEPS
    assert_close(
        safetensors.torch.load_file(_checkpoint(outs["loss"], STEPS) / "model.safetensors"),
        safetensors.torch.load_file(_checkpoint(outs["single"], STEPS) / "model.safetensors"),
    )
    # The machine left without its rendezvous host says so, within --timeout.
    assert procs["master-h1"].returncode == 1, master_log[-3000:]
    assert "The machine hosting the rendezvous at dt-h2:29702" in master_log, master_log[-3000:]
    assert "stopped or became unreachable" in master_log
    assert "Traceback" not in master_log
    assert master_ended - killed < TIMEOUT_S, master_log[-3000:]


def test_the_rendezvous_waits_follow_the_timeout_and_the_last_call() -> None:
    """Heartbeats: torch's 5 s for long timeouts, a twelfth of --timeout for short ones,
    1 s at least; the join wait covers the dead machine's grace and the last call."""
    from dtrain.config import Config
    from dtrain.launcher.runner import join_timeout, keep_alive_interval

    assert [keep_alive_interval(Config(timeout_s=t)) for t in (600, 30, 10, 1)] == [5, 2, 1, 1]
    assert join_timeout(Config(timeout_s=600)) == 600 + 15 + 3
    assert join_timeout(Config(timeout_s=10, last_call_s=7)) == 10 + 3 + 7
    with pytest.raises(ConfigError, match="--last-call must be a whole number of seconds"):
        Config(last_call_s=0).validate()


def test_a_rendezvous_host_that_stops_answering_is_reported_after_the_timeout() -> None:
    """The side watch (a cut link gives the agent no error for many minutes): silent while
    the host accepts connections, `on_lost` once none has succeeded for the timeout."""
    from dtrain.launcher.watch import _watch

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        lost: list[float] = []
        done = threading.Event()
        watching = threading.Thread(
            target=_watch, args=("127.0.0.1", port, 1.5, lambda: lost.append(1), done)
        )
        watching.start()
        time.sleep(2.5)
        assert not lost  # answering: nothing to report
    started = time.monotonic()  # the listener is closed: connections are refused now
    watching.join(timeout=10)
    assert lost and 1.0 <= time.monotonic() - started < 5
    done.set()
