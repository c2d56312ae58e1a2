"""A failed job's report leads with its cause: a rank killed by a signal before the ranks
that lost their connection to it, a rank that hung before the rank that timed out waiting
for it; a killed rank is told how to resume; ranks that all stopped on the same refusal
show no stacks that would read as a hang; and a parameter server killed mid-training is
named by the workers as the peer that stopped, under async and sync ps."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest
from conftest import run_cli
from test_ps import KILLED_WORKER
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtrain import advice
from dtrain.config import Config
from dtrain.launcher.failures import format_failures
from dtrain.strategies.ps.protocol import Channel, ParameterServerError
from dtrain.strategies.ps.roles import Roles

DUMP = """\
Current thread 0x00007f0000000001 (most recent call first):
  File "train.py", line 10 in <module>
"""

TIMED_OUT = """\
Traceback (most recent call last):
  File "train.py", line 11, in <module>
RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv"""

CLOSED = (
    "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6558. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker."
)


def failure(
    rank: int, exitcode: int, message: str | None = None, error: bool = True
) -> ProcessFailure:
    """The agent's record of a rank that ended with `exitcode`; `message`: what it
    reported, as the launcher's bootstrap writes it (a dtrain error if `error`, else a
    traceback)."""
    record = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="")
    if message is not None:
        record.error_file_data = {
            "dtrain": {"message": message, "traceback": message, "user_error": error}
        }
    return record


def test_a_killed_rank_is_told_how_to_resume() -> None:
    with advice.running_as(advice.DEMO):
        text = format_failures({1: failure(1, -signal.SIGKILL), 0: failure(0, -signal.SIGTERM)})
    assert text.startswith(f"Rank 1 (local rank 1, pid 101, host {socket.gethostname()}) was")
    assert "killed by signal SIGKILL" in text
    assert "the checkpoints already written are intact (dtrain demo continues from the " in text
    assert "last checkpoint with --resume)." in text


def test_a_killed_server_leads_the_workers_that_lost_it() -> None:
    lost = f"Worker 0 sending to server 0 failed: the connection ended ({CLOSED})"
    failures = {0: failure(0, 1, lost), 2: failure(2, -signal.SIGKILL)}
    text = format_failures(failures, role=lambda r: "server 0" if r == 2 else f"worker {r}")
    assert text.startswith("Rank 2 (server 0, local rank 2, pid 102"), text
    assert text.index("Rank 0 (worker 0") > text.index("was killed by signal SIGKILL"), text


def test_the_rank_that_hung_is_named_first_with_where_it_stood() -> None:
    failures = {0: failure(0, 1, TIMED_OUT, error=False), 1: failure(1, -signal.SIGTERM)}
    text = format_failures(failures, stacks={1: DUMP})
    assert text.startswith(
        "Rank 1 hung: rank 0 waited longer than --timeout for it, and it was still running "
        'when the launcher stopped it, here (most recent call first):\n  File "train.py", '
        "line 10 in <module>\n\nRank 0 (local rank 0"
    ), text


def test_ranks_that_all_stopped_on_one_refusal_show_no_stacks() -> None:
    refusal = "A model without a pipeline plan cannot be split; add pipeline_layers()."
    failures = {0: failure(0, 1, refusal), 1: failure(1, -signal.SIGTERM, refusal)}
    text = format_failures(failures, stacks={1: DUMP})
    assert "still running" not in text and "train.py" not in text and "hung" not in text, text
    assert text.endswith("Rank(s) 1 were stopped by the launcher after that."), text


class _Failed:
    """A send or receive that gloo ended with `error`."""

    def __init__(self, error: str) -> None:
        self.error = error

    def wait(self, timeout: object) -> None:
        raise RuntimeError(self.error)


def ps_channel() -> Channel:
    """Worker 1's channel of a job of 2 workers and 1 server (global rank 2)."""
    return Channel(None, Roles.of(Config(strategy="ps", nproc=2, servers=1)), 1)  # type: ignore[arg-type]


def test_a_closed_connection_names_the_server_that_stopped() -> None:
    with (
        advice.running_as(advice.DEMO),
        pytest.raises(ParameterServerError) as caught,
    ):
        ps_channel().wait(_Failed(CLOSED), 600, "Worker 1 sending to server 0", 2)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "did not complete" not in message
    assert message.startswith(
        "Worker 1 sending to server 0 failed: the connection ended (Connection closed by peer "
        "[127.0.0.1]:6558) because server 0 (rank 2, at 127.0.0.1) stopped"
    ), message
    assert message.endswith("(dtrain demo continues from the last checkpoint with --resume)."), (
        message
    )


def test_a_wait_that_timed_out_says_so() -> None:
    timed_out = "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv"
    with pytest.raises(ParameterServerError, match=r"did not complete within 600s \(Timed out"):
        ps_channel().wait(_Failed(timed_out), 600, "Worker 1 waiting for server 0", 2)  # type: ignore[arg-type]


FINDS_THE_SERVER = """
import os, signal
from pathlib import Path

# The launcher stops the workers once it sees the server die; ignoring its SIGTERM lets
# each worker always meet the closed connection and report it, whichever comes first.
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def server_pid():
    # The launcher started every rank: the server is the sibling whose RANK is 2.
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\\0")
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == os.getppid() and b"RANK=2" in environ:
            return int(entry.name)
    raise RuntimeError("no server rank found")
"""

KILLS_THE_SERVER = FINDS_THE_SERVER + KILLED_WORKER.replace(
    "engine.rank == 1 and step == 5", "engine.rank == 0 and step == 3"
).replace("os.kill(os.getpid(), signal.SIGKILL)", "os.kill(server_pid(), signal.SIGKILL)")
"""test_ps's killed worker, where worker 0 kills the server instead at its fourth step."""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_killed_server_is_named_as_the_cause(tmp_path: Path, mode: str) -> None:
    (tmp_path / "kills.py").write_text(KILLS_THE_SERVER)
    proc = run_cli(
        "run", "--strategy", "ps", "--ps-mode", mode, "--nproc", "2", "--servers", "1",
        "--timeout", "60", "kills.py", cwd=tmp_path, timeout=130,
    )  # fmt: skip
    report = proc.stderr[proc.stderr.index("the job failed.") :]
    assert proc.returncode == 1, proc.stderr
    first = report.splitlines()[1]
    assert first.startswith("Rank 2 (server 0, local rank 2, pid "), report
    assert first.endswith(f", host {socket.gethostname()}) was killed by signal SIGKILL:"), report
    assert "a script that calls engine.resume continues from the last checkpoint" in report
    # Each worker met the closed connection (it ignored the launcher's stop) and says that
    # server 0 stopped, not that a wait timed out.
    for worker in (0, 1):
        assert f"Rank {worker} (worker {worker}, local rank {worker}" in report, report
        assert f"Worker {worker} " in report, report
    assert report.count("because server 0 (rank 2, at ") == 2, report
    assert "did not complete" not in report and "Traceback" not in report, report
