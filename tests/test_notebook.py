"""`dtrain.launch` from a notebook or a REPL: a function with no file to import it from
runs on forked ranks, their output comes back prefixed by rank, their results in rank
order, and a failure, a timeout or Ctrl-C stops every rank and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.launcher.forked import GRACE_S

SRC = Path(__file__).resolve().parents[1] / "src"

# Fed to `python -` on standard input: `train` lives in a __main__ that has no file.
SCRIPT = """
import json
import torch
import torch.nn.functional as F
import dtrain


def train(steps):
    engine = dtrain.init()
    net = torch.nn.Linear(4, 1)
    engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.arange(32.0).reshape(8, 4) / 32
    y = torch.ones(8, 1)
    for _ in range(steps):
        engine.train_step((x, y), F.mse_loss)
    engine.evaluate([(x, y)], F.mse_loss)  # brings ps workers' parameters up to date
    print(f"rank {engine.rank} trained")
    return engine.rank, [p.detach().tolist() for p in net.parameters()]


# Two runs compared: both are given the same seed.
print("RESULT ddp", json.dumps(dtrain.launch(train, 2, nproc=2, seed=0)))
print("RESULT ps", json.dumps(dtrain.launch(train, 2, nproc=2, strategy="ps", servers=1, seed=0)))
"""


def _children() -> set[int]:
    """Processes whose parent is this one, running or not yet reaped."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


def _rank() -> int:
    return int(os.environ["RANK"])


def _fail_on_rank_1() -> None:
    if _rank() == 1:
        raise ValueError("boom")
    time.sleep(60)


def _sleep() -> None:
    time.sleep(60)


def _return_a_lambda() -> object:
    return lambda: _rank()


def _exit_at_once() -> None:
    os._exit(7)


def _kill_myself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_function_from_standard_input_trains_on_two_ranks() -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    env.pop("DTRAIN_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-"], input=SCRIPT, env=env, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    results = {
        line.split()[1]: json.loads(line.split(maxsplit=2)[2])
        for line in lines
        if line.startswith("RESULT")
    }
    ddp, ps = results["ddp"], results["ps"]
    assert [rank for rank, _ in ddp] == [0, 1]
    assert ddp[0][1] == ddp[1][1]
    # Only the two workers answer; the server rank the launch added returns nothing.
    assert [rank for rank, _ in ps] == [0, 1]
    assert ps[0][1] == ps[1][1]
    torch.testing.assert_close(ps[0][1], ddp[0][1])  # both train like single
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} trained" in lines


@pytest.mark.timeout(60)
def test_a_failing_rank_is_reraised_and_the_others_stopped() -> None:
    before = _children()
    started = time.monotonic()
    with pytest.raises(dtrain.LaunchError) as error:
        dtrain.launch(_fail_on_rank_1, nproc=2)
    message = str(error.value)
    assert message.startswith("Rank 1 failed")
    assert "Traceback (most recent call last):" in message
    assert "in _fail_on_rank_1" in message
    assert "ValueError: boom" in message
    assert "Rank 0 was stopped after that." in message
    assert time.monotonic() - started < GRACE_S  # rank 0 ended at SIGTERM
    assert _children() <= before

    with pytest.raises(dtrain.LaunchError, match="Rank 0 exited with code 7 before returning"):
        dtrain.launch(_exit_at_once)
    with pytest.raises(
        dtrain.LaunchError, match="Rank 0 was killed by signal SIGKILL before"
    ) as error:
        dtrain.launch(_kill_myself)
    assert "checkpoints already written are intact" in str(error.value)  # and how to resume

    with pytest.raises(dtrain.LaunchError, match="cannot be pickled") as error:
        dtrain.launch(_return_a_lambda)
    assert "model.state_dict()" in str(error.value)
    assert _children() <= before


@pytest.mark.timeout(60)
def test_a_timeout_and_ctrl_c_stop_every_rank() -> None:
    before = _children()
    started = time.monotonic()
    with pytest.raises(dtrain.LaunchError) as error:
        dtrain.launch(_sleep, nproc=2, timeout=3)
    assert str(error.value).startswith("Ranks 0, 1 had not finished after the timeout of 3 s")
    assert 3 <= time.monotonic() - started < 3 + GRACE_S
    assert _children() <= before

    interrupt = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        dtrain.launch(_sleep, nproc=2)
    interrupt.join()
    assert _children() <= before


def test_what_cannot_work_is_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _children()
    with pytest.raises(dtrain.ConfigError, match="Unknown option"):
        dtrain.launch(_sleep, nproc=2, bogus=1)
    with pytest.raises(dtrain.ConfigError, match="--log-every must be at least 1"):
        dtrain.launch(_sleep, nproc=2, log_every=0)
    with pytest.raises(dtrain.ConfigError, match="wrong type"):
        dtrain.launch(_sleep, nproc="2")
    with pytest.raises(dtrain.ConfigError, match="runs in one process"):
        dtrain.launch(_sleep, nproc=2, strategy="towers")
    with pytest.raises(dtrain.ConfigError, match="dtrain run"):
        dtrain.launch(_sleep, nproc=2, max_restarts=1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(dtrain.ConfigError, match="restart the kernel"):
        dtrain.launch(_sleep, nproc=2)
    assert _children() <= before
