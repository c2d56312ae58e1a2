"""A machine lost across the network is named, by name, address and ranks, in the report
of the machines left (issue 24, item 5).

The job's machines publish themselves in its store when their workers start, each with a
beacon port; after a failure the launcher knocks at the others' beacons, and a rank that
lost its peer is told which machine does not answer any more. End to end: a job on two
test hosts (tests/cluster.py) whose second host's link goes down mid-step, and one whose
second host is killed in the middle of a sharded save (issue 35): the first host's report
names the lost one, the last checkpoint committed verifies, and the demo resumed from it
ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import cluster
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from conftest import run_ckpt, run_cli
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.testing import assert_close

from dtrain.checkpoint import find_latest, step_path
from dtrain.config import Config
from dtrain.launcher.failures import TIMED_OUT, format_failures
from dtrain.launcher.machines import HOST_NAME_VAR, Machine, Roster, Survey, _beacon, roster_of

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

STEPS = 6
DEMO = ("--model", "mlp", "--steps", str(STEPS), "--checkpoint-every", "1", "--seed", "0")

HALTS = """\
import os, sys, time
from pathlib import Path
import torch.distributed.checkpoint as dcp
import dtrain
from dtrain.demo import script as demo

# RANK WHERE STEP MARKER, then the demo's flags. Rank RANK halts, and says so by making
# the file MARKER: at "step", before training step STEP + 1; at "save", in the save of
# step STEP once every rank's pieces are written, before the manifest that makes them a
# checkpoint. It goes on once the file MARKER.go appears.
rank, where, step, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])


def halt():
    marker.touch()
    while not marker.with_suffix(".go").exists():
        time.sleep(0.05)


train_step, save = dtrain.Engine.train_step, dcp.save


def train_step_or_halt(engine, *args, **kwargs):
    if engine.step == step:
        halt()
    return train_step(engine, *args, **kwargs)


def save_then_halt(state, *, checkpoint_id, **kwargs):
    done = save(state, checkpoint_id=checkpoint_id, **kwargs)
    if Path(checkpoint_id).name.startswith(f".step-{step:08d}.tmp-"):
        halt()
    return done


if os.environ["RANK"] == rank and where == "step":
    dtrain.Engine.train_step = train_step_or_halt
if os.environ["RANK"] == rank and where == "save":
    dcp.save = save_then_halt
demo.main(sys.argv[5:])
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The parameters of the demo run whole in this process: what every resumed run must
    end with."""
    from dtrain.demo import script as demo

    out = tmp_path_factory.mktemp("uninterrupted")
    demo.main([*DEMO, "--out", str(out)])
    return safetensors.torch.load_file(step_path(out / "checkpoints", STEPS) / "model.safetensors")


def _run_halted(
    hosts: cluster.Cluster, tmp_path: Path, halt: tuple[int, str, int], *flags: str
) -> tuple[list[subprocess.Popen[str]], list[Path], Path]:
    """Start the digits demo (ddp, a checkpoint each step, `flags`) on dt-h1 and dt-h2, as
    nodes 0 and 1, rank `halt[0]` halting where the rest of `halt` says (`HALTS`); return
    once it has halted: the hosts' jobs, their logs, and the file that lets it go on."""
    script, marker = tmp_path / "train.py", tmp_path / "halted"
    script.write_text(HALTS)
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    job = ("run", "--strategy", "ddp", "--nnodes", "2", "--master", "dt-h1:29801", *flags)
    trains = (str(script), *map(str, halt), str(marker), *DEMO, "--out", "job")
    procs = [
        hosts.popen(
            host,
            cluster.dtrain_command(
                *job, "--timeout", str(TIMEOUT_S), "--node-rank", str(node), *trains
            ),
            cwd=tmp_path,
            env=cluster.job_env(),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for node, (host, log) in enumerate(zip(hosts.hosts, logs, strict=True))
    ]
    deadline = time.monotonic() + 90
    while not marker.exists():
        assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
        assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    return procs, logs, marker.with_suffix(".go")


def _survivor_report(proc: subprocess.Popen[str], log: Path, cut: float, lost: str) -> str:
    """The report of a survivor's job, which must end (failed) within --timeout of the
    `cut` (with the time its probe of the others and its teardown take), naming the
    machine `lost` with its rank."""
    proc.wait(timeout=TIMEOUT_S + 30)
    print(
        f"the survivor ended {time.monotonic() - cut:.1f} s after the cut (--timeout {TIMEOUT_S})"
    )
    report = log.read_text()
    assert proc.returncode == 1, report[-3000:]
    assert f"It lost its connection to machine {lost} ran, which" in report, report[-3000:]
    return report


def _resumes_exactly(
    tmp_path: Path, committed: int, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """The newest checkpoint of the job is `committed`, which verifies; the demo resumed
    from it ends with the parameters of the uninterrupted run."""
    root = tmp_path / "job" / "checkpoints"
    assert find_latest(root) == step_path(root, committed), sorted(os.listdir(root))
    verified = run_ckpt("verify", str(step_path(root, committed)))
    assert verified.returncode == 0, verified.stderr
    resumed = run_cli("demo", *DEMO, "--resume", "--out", "job", cwd=tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed at step {committed} from a" in resumed.stdout, resumed.stdout[-3000:]
    final = step_path(root, STEPS) / "model.safetensors"
    assert_close(safetensors.torch.load_file(final), uninterrupted)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}")
@pytest.mark.timeout(150)
def test_a_host_whose_link_goes_down_is_named_with_its_rank(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """dt-h2's link goes down while dt-h1 waits on it in step 4: dt-h1 names it; the
    checkpoint of step 3 is the last, intact, and resuming from it trains as an
    uninterrupted run."""
    with cluster.cluster(2, rate="1gbit") as hosts:
        procs, logs, go = _run_halted(hosts, tmp_path, (1, "step", 3))
        cut = time.monotonic()
        subprocess.run(
            ["ip", "-n", hosts.host("dt-h2").netns, "link", "set", "eth0", "down"], check=True
        )
        go.touch()  # dt-h2 goes on into step 4, cut off
        report = _survivor_report(procs[0], logs[0], cut, "dt-h2 (10.77.0.2), where rank 1")
    assert "which does not answer this machine either" in report, report[-3000:]
    _resumes_exactly(tmp_path, 3, uninterrupted)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}")
@pytest.mark.timeout(150)
def test_a_host_lost_during_a_sharded_save_leaves_the_last_checkpoint(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """dt-h1 (rank 0, which writes the manifest) is killed while the sharded checkpoint
    of step 3 is being written, every rank's pieces on disk: dt-h2 names it, the pieces
    never become a checkpoint, and resuming from step 2's trains as an uninterrupted run."""
    root = tmp_path / "job" / "checkpoints"
    with cluster.cluster(2, rate="1gbit") as hosts:
        procs, logs, _ = _run_halted(
            hosts, tmp_path, (0, "save", 3), "--checkpoint-format", "sharded"
        )
        (half,) = root.glob(".step-00000003.tmp-*")
        assert any(half.glob("*.distcp")) and not (half / "manifest.json").exists()
        cut = time.monotonic()
        hosts.kill(hosts.host("dt-h1"))
        _survivor_report(procs[1], logs[1], cut, "dt-h1 (10.77.0.1), where rank 0")
    assert not step_path(root, 3).exists() and (half / ".metadata").is_file()
    refused = run_ckpt("verify", str(half))
    assert "is not a dtrain checkpoint (no manifest.json)" in refused.stderr, refused.stderr
    _resumes_exactly(tmp_path, 2, uninterrupted)
    assert not half.exists()  # the resume cleared it away
