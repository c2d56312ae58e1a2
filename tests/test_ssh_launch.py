"""One command starts every host over ssh (-H, --hostfile): the hosts here are two names
of this machine (127.0.0.1 and localhost) served by a test sshd; a failure anywhere
named, Ctrl-C stopping every host, an unreachable host reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_cli
from distributed import free_port
from sshd import Sshd, ssh_environment, start_sshd, why_no_sshd

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.launcher.hosts import Host, hosts_of, parse_hosts, read_hostfile

SCRIPT = """
import os, sys, time
import torch
import torch.nn.functional as F
import dtrain

engine = dtrain.init(seed=0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = engine.setup(model, optimizer)
g = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
data = torch.utils.data.TensorDataset(inputs, targets)
loader = engine.dataloader(data, global_batch_size=16)
if sys.argv[1] == "fail" and engine.rank == 1:
    raise RuntimeError("planted failure on rank 1")
for batch in engine.progress(loader):
    engine.train_step(batch, F.cross_entropy)
    if sys.argv[1] == "sleep":
        time.sleep(0.5)
    if engine.step == 6:
        break
state = engine.state_dict()
print(f"rank {engine.rank} done", flush=True)
if engine.is_main:
    torch.save(state, sys.argv[2])
engine.close()
"""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    reason = why_no_sshd()
    if reason:
        pytest.skip(reason)
    daemon = start_sshd(tmp_path_factory.mktemp("sshd"), "127.0.0.1", free_port())
    yield daemon
    daemon.stop()


def _head(sshd: Sshd) -> list[str]:
    return [
        sys.executable, "-m", "dtrain.cli", "run", "-H", "127.0.0.1:1,localhost:1",
        "--ssh-port", str(sshd.port), "--ssh-identity", str(sshd.identity), "--timeout", "60",
    ]  # fmt: skip


def _environment(sshd: Sshd) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    return {**env, **ssh_environment(sshd), "PYTHONUNBUFFERED": "1"}


def _left_behind() -> list[str]:
    found = subprocess.run(
        ["pgrep", "-af", "dtrain.launcher.remote|train_ssh.py"], capture_output=True, text=True
    )
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


@pytest.mark.timeout(240)
def test_a_failure_on_any_host_is_named_with_its_report(sshd: Sshd, tmp_path: Path) -> None:
    """(Training over ssh equal to one process: tests/test_multihost.py, on test hosts.)"""
    script = tmp_path / "train_ssh.py"
    script.write_text(SCRIPT)
    env = _environment(sshd)
    failed = subprocess.run(
        [*_head(sshd), "--strategy", "ddp", str(script), "fail", "x"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert failed.returncode == 1
    assert "localhost (node 1) ended with exit code 1" in failed.stderr
    assert "RuntimeError: planted failure on rank 1" in failed.stderr
    assert _left_behind() == []


@pytest.mark.timeout(240)
def test_ctrl_c_on_the_head_stops_every_host(sshd: Sshd, tmp_path: Path) -> None:
    script = tmp_path / "train_ssh.py"
    script.write_text(SCRIPT)
    head = subprocess.Popen(
        [*_head(sshd), "--strategy", "ddp", str(script), "sleep", "x"],
        cwd=tmp_path, env=_environment(sshd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert head.stdout is not None
    for line in head.stdout:  # wait until both hosts train
        if "global batch" in line:
            break
    time.sleep(1)
    head.send_signal(signal.SIGINT)
    _, err = head.communicate(timeout=60)
    assert head.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "stopped by SIGINT" in err
    deadline = time.monotonic() + 20
    while _left_behind() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _left_behind() == []


def test_an_unreachable_host_is_named_with_its_port(tmp_path: Path) -> None:
    if why_no_sshd():
        pytest.skip(why_no_sshd())
    port = free_port()  # nobody listens there
    (tmp_path / "x.py").write_text("")
    done = run_cli(
        "run",
        "-H",
        "127.0.0.1:1,localhost:1",
        "--ssh-port",
        str(port),
        "--timeout",
        "20",
        "x.py",
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert f"Could not reach 127.0.0.1 over ssh (port {port})" in done.stderr


def test_hosts_from_the_command_line_and_from_a_hostfile(tmp_path: Path) -> None:
    assert parse_hosts(["a:2", "b:2"], 1) == [Host("a", 2), Host("b", 2)]
    assert parse_hosts(["a", "b"], 3) == [Host("a", 3), Host("b", 3)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode01 slots=4\nnode02 slots=4  # spare\n\n")
    assert read_hostfile(hostfile, 1) == [Host("node01", 4), Host("node02", 4)]
    assert hosts_of(Config(hostfile=str(hostfile))) == [Host("node01", 4), Host("node02", 4)]
    assert Config(hosts=["a:2", "b:2"]).strategy == "ddp"
    for bad, message in (
        (["a:2", "b:3"], "different numbers of slots"),
        (["a:2", "a:2"], "appear more than once"),
        (["a:zero"], "Cannot read the host 'a:zero'"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_hosts(bad, 1)
    hostfile.write_text("node01 slots=x\n")
    with pytest.raises(ConfigError, match=r"line 1"):
        read_hostfile(hostfile, 1)
    with pytest.raises(ConfigError, match="Cannot read the hostfile"):
        read_hostfile(tmp_path / "missing", 1)
    with pytest.raises(ConfigError, match="not both"):
        Config(hosts=["a:1"], hostfile=str(hostfile))
    with pytest.raises(ConfigError, match="drop those flags"):
        Config(hosts=["a:1"], nnodes=2, master="a:1234")
