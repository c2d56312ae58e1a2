"""A machine lost across the network is named, by name, address and ranks, in the report
of the machines left (issue 24, item 5).

The job's machines publish themselves in its store when their workers start, each with a
beacon port; after a failure the launcher knocks at the others' beacons, and a rank that
lost its peer is told which machine does not answer any more. End to end: a job on two
test hosts (tests/cluster.py) whose second host's link goes down mid-training."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import cluster
import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtrain.config import Config
from dtrain.launch.failures import TIMED_OUT, format_failures
from dtrain.launch.machines import HOST_NAME_VAR, Machine, Roster, Survey, _beacon, roster_of

TIMEOUT_S = 10
GLOO_TIMEOUT = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer."
    "cc:78] Timed out waiting 10000ms for recv operation to complete"
)
CLOSED = "RuntimeError: [../tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4321"

A = Machine(0, "hostA", "a", "10.0.0.1", 1, (0, 1))
B = Machine(1, "", "hostB", "10.0.0.2", 1, (2, 3))
C = Machine(2, "hostC", "c", "10.0.0.3", 1, (4, 6))


def _failed(last_line: str) -> dict[int, ProcessFailure]:
    """Rank 0 failed with a traceback ending in `last_line`; rank 1 was stopped after."""
    failures = {
        r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file="")
        for r, code in ((0, 1), (1, -signal.SIGTERM))
    }
    traceback = f'Traceback (most recent call last):\n  File "train.py", line 9\n{last_line}'
    failures[0].error_file_data = {
        "dtrain": {"message": last_line, "traceback": traceback, "user_error": False}
    }
    return failures


def test_machines_are_described_by_name_address_and_ranks() -> None:
    assert (A.describe(), A.held()) == ("hostA (10.0.0.1)", "ranks 0-1")
    assert (B.describe(), C.held()) == ("hostB (10.0.0.2)", "ranks 4, 6")
    assert Machine(3, "10.0.0.4", "", "10.0.0.4", 1, (7,)).describe() == "10.0.0.4"
    assert Machine(3, "", "", "10.0.0.4", 1, (7,)).held() == "rank 7"


def test_a_rank_that_lost_a_peer_is_told_which_machine_it_was() -> None:
    """On machine A: B silent (A hosts the rendezvous); then A silent, seen from B; an
    address named in the error whose machine still answers; a machine silent while the
    rank failed otherwise; every other machine silent; nothing silent, no address."""
    b_silent = Survey(others=(B,), silent=(B,), rendezvous=A, elastic=False)
    text = format_failures(_failed(GLOO_TIMEOUT), survey=b_silent)
    assert (
        "It lost its connection to machine hostB (10.0.0.2), where ranks 2-3 ran, which does "
        "not answer this machine either" in text
    ), text
    assert "unless that is hostA (10.0.0.1), the machine that hosts the rendezvous" in text
    assert TIMED_OUT not in text

    a_silent = Survey(others=(A,), silent=(A,), rendezvous=A, elastic=False)
    text = format_failures(_failed(GLOO_TIMEOUT), survey=a_silent)
    assert "machine hostA (10.0.0.1), where ranks 0-1 ran, which does not" in text, text
    assert "No job goes on without hostA (10.0.0.1), the machine that hosts" in text

    answering = Survey(others=(B, C), silent=(), rendezvous=A, elastic=False)
    text = format_failures(_failed(CLOSED), survey=answering)
    assert "machine hostB (10.0.0.2), where ranks 2-3 ran, which still answers" in text, text

    text = format_failures(_failed("ValueError: bad input"), survey=b_silent)
    assert "bad input\n\nMachine hostB (10.0.0.2), where ranks 2-3 ran, does not" in text

    all_silent = Survey(others=(B, C), silent=(B, C), rendezvous=A, elastic=True)
    text = format_failures(_failed(GLOO_TIMEOUT), survey=all_silent)
    assert "machines hostB (10.0.0.2), where ranks 2-3 ran and hostC (10.0.0.3), where" in text
    assert "No other machine of the job answers" in text and "raise it to survive" in text

    assert TIMED_OUT in format_failures(_failed(GLOO_TIMEOUT), survey=answering)


def test_the_machines_meet_in_the_store_and_a_silent_one_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two launchers gather through one store; a live beacon and a closed port both
    answer (a refusal comes from a live machine); a port whose queue is full, as a
    machine that does not answer looks, does not."""
    store = dist.PrefixStore("job", dist.HashStore())
    rosters = [Roster(f"n{n}", "127.0.0.1", "127.0.0.1", False, 30) for n in range(2)]
    with _beacon(rosters[1]):
        gathering = [
            threading.Thread(target=roster.gather, args=(store, n, 2, [n]))
            for n, roster in enumerate(rosters)
        ]
        for thread in gathering:
            thread.start()
        for thread in gathering:
            thread.join(timeout=30)
        assert rosters[0].machines == rosters[1].machines
        survey = rosters[0].survey(within_s=5)
        assert survey is not None and survey.others == (rosters[0].machines[1],)
        assert not survey.silent and survey.rendezvous == rosters[0].machines[0]
    assert rosters[0].survey(within_s=5).silent == ()  # type: ignore[union-attr]
    with socket.create_server(("127.0.0.1", 0), backlog=0) as frozen:
        port = frozen.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue: Linux drops the rest
            rosters[0].machines[1] = Machine(1, "gone", "", "127.0.0.1", port, (1,))
            survey = rosters[0].survey(within_s=0.5)
    assert survey is not None and survey.silent == (rosters[0].machines[1],)

    alone = Roster("", "127.0.0.1", "127.0.0.1", False, 0.2)
    alone.gather(dist.HashStore(), 0, 2, [0])  # node 1 never comes: no roster, no wait
    assert alone.survey() is None

    monkeypatch.setenv(HOST_NAME_VAR, "hostA")
    config = Config(nnodes=2, master="127.0.0.1:29500")
    roster = roster_of(config, "127.0.0.1:29500")
    assert roster is not None and (roster.name, roster.address) == ("hostA", "127.0.0.1")
    assert roster_of(Config(), "localhost:0") is None


WHY_NOT = cluster.unavailable()

TRAINS = """\
import itertools, time
import torch, torch.nn.functional as F
import dtrain
engine = dtrain.init()
model = torch.nn.Linear(4, 2)
model, opt = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
loader = engine.dataloader(data, batch_size=8)
for epoch in itertools.count():
    for batch in loader:
        engine.train_step(batch, F.cross_entropy)
        print(f"step {engine.step}", flush=True)
        time.sleep(0.1)
"""


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}")
@pytest.mark.timeout(150)
def test_a_host_whose_link_goes_down_is_named_with_its_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINS)
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    with cluster.cluster(2, rate="1gbit") as hosts:
        procs = [
            hosts.popen(
                host,
                cluster.dtrain_command(
                    "run",
                    "--strategy",
                    "ddp",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master",
                    "dt-h1:29801",
                    "--timeout",
                    str(TIMEOUT_S),
                    str(script),
                ),
                cwd=tmp_path,
                env=cluster.job_env(),
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for node, (host, log) in enumerate(zip(hosts.hosts, logs, strict=True))
        ]
        deadline = time.monotonic() + 90
        while "step 3" not in logs[0].read_text():
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        cut = time.monotonic()
        subprocess.run(
            ["ip", "-n", hosts.host("dt-h2").netns, "link", "set", "eth0", "down"], check=True
        )
        procs[0].wait(timeout=TIMEOUT_S * 3 + 30)
        took = time.monotonic() - cut
    report = logs[0].read_text()
    assert procs[0].returncode == 1, report[-3000:]
    assert (
        "It lost its connection to machine dt-h2 (10.77.0.2), where rank 1 ran, which does "
        "not answer this machine either" in report
    ), report[-3000:]
    print(f"dt-h1 named dt-h2 {took:.1f} s after its link went down (--timeout {TIMEOUT_S})")
