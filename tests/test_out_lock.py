"""One run per --out: the lock a `dtrain demo` launcher holds on its output folder for the
run's life. A live run of this host is refused by name, a gone one's lock taken over with
a note, another host's refused with the file to delete; of two takers one wins; and a
second `dtrain demo` into a busy --out is refused before it trains or deletes anything."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from conftest import run_cli

from dtrain.checkpoint import out_lock
from dtrain.checkpoint.out_lock import LOCK_NAME, Owner, take, this_process
from dtrain.demo.checks import claim_out
from dtrain.errors import ConfigError


def write_lock(directory: Path, owner: Owner) -> Path:
    """A lock naming `owner` in `directory`, as another run would have left it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    path.write_text(json.dumps(asdict(owner)))
    return path


def gone_process() -> Owner:
    """The owner a lock names for a process of this host that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    ticks = out_lock._start_ticks(child.pid)
    owner = Owner(socket.gethostname(), child.pid, "2020-01-01 00:00:00 UTC", ticks)
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    return owner


def test_take_names_this_process_and_release_removes_it(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    lock = take(out)
    named = json.loads((out / LOCK_NAME).read_text())
    assert (named["host"], named["pid"]) == (socket.gethostname(), os.getpid())
    assert list(out.iterdir()) == [out / LOCK_NAME]  # the file written beside it is gone
    lock.release()
    assert not (out / LOCK_NAME).exists()
    with take(out):
        assert (out / LOCK_NAME).is_file()
    assert not (out / LOCK_NAME).exists()


def test_of_two_takers_one_wins(tmp_path: Path) -> None:
    first = take(tmp_path)
    with pytest.raises(ConfigError, match="in use by another dtrain run"):
        take(tmp_path)
    assert out_lock._read(tmp_path / LOCK_NAME) == first.owner
    first.release()


def test_a_live_run_of_this_host_is_refused_by_name(tmp_path: Path) -> None:
    owner = this_process()  # the test's own process: alive
    path = write_lock(tmp_path, owner)
    with pytest.raises(ConfigError) as refused:
        take(tmp_path)
    message = str(refused.value)
    for part in (f"pid {owner.pid}", f"host {owner.host}", f"started {owner.started}"):
        assert part in message
    assert "Wait for it to finish, or choose another --out" in message
    assert "--overwrite does not stop a running run" in message
    assert out_lock._read(path) == owner


def test_a_gone_run_of_this_host_is_taken_over_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = gone_process()
    path = write_lock(tmp_path, gone)
    lock = take(tmp_path)
    assert out_lock._read(path) == lock.owner
    note = capsys.readouterr().err
    assert note.count("\n") == 1
    assert f"taking over {path}" in note and f"pid {gone.pid} on host {gone.host}" in note
    lock.release()


def test_a_reused_pid_is_not_the_run_that_locked(tmp_path: Path) -> None:
    me = this_process()
    if me.ticks is None:
        pytest.skip("no /proc/PID/stat to tell a reused pid by")
    write_lock(tmp_path, replace(me, ticks=me.ticks - 1))  # this pid, an earlier process
    take(tmp_path).release()


def test_another_hosts_lock_is_refused_with_the_file_to_delete(tmp_path: Path) -> None:
    other = Owner("gpu-node-7", 4242, "2020-01-01 00:00:00 UTC", 12345)
    path = write_lock(tmp_path, other)
    with pytest.raises(ConfigError) as refused:
        take(tmp_path)
    message = str(refused.value)
    assert "on host gpu-node-7 (pid 4242" in message
    assert "cannot tell" in message and f"delete {path} by hand" in message
    assert out_lock._read(path) == other


def test_the_machines_of_one_job_share_its_lock(tmp_path: Path) -> None:
    """An elastic job's machines each launch as node 0 into one --out (a shared file
    system): the lock of its first machine is the job's; another job is refused."""
    first = Owner("gpu-node-7", 4242, "2020-01-01 00:00:00 UTC", 12345, job="node-a:29500")
    path = write_lock(tmp_path, first)
    with take(tmp_path, job="node-a:29500") as shared:
        assert shared.shared and shared.owner == first
    assert out_lock._read(path) == first  # left to the machine that took it
    with pytest.raises(ConfigError, match="on host gpu-node-7"):
        take(tmp_path, job="node-b:29500")
    with pytest.raises(ConfigError, match="on host gpu-node-7"):
        take(tmp_path)


def test_an_unreadable_lock_is_refused(tmp_path: Path) -> None:
    path = tmp_path / LOCK_NAME
    path.write_text("")
    with pytest.raises(ConfigError, match=f"delete {path} by hand"):
        take(tmp_path)
    assert path.read_text() == ""


def test_clearing_a_stale_lock_spares_one_another_taker_placed_meanwhile(
    tmp_path: Path,
) -> None:
    gone = gone_process()
    winner = this_process()
    fresh = write_lock(tmp_path, winner)  # it replaced the stale lock before this taker could
    assert not out_lock._remove_if_unchanged(fresh, gone)
    assert out_lock._read(fresh) == winner
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]


def test_release_leaves_a_lock_another_run_took(tmp_path: Path) -> None:
    lock = take(tmp_path)
    other = Owner("gpu-node-7", 4242, "2020-01-01 00:00:00 UTC", None)
    write_lock(tmp_path, other)  # deleted by hand and taken by another run
    lock.release()
    assert out_lock._read(tmp_path / LOCK_NAME) == other


def test_claim_out_locks_before_overwrite_deletes(tmp_path: Path) -> None:
    saved = tmp_path / "checkpoints" / "step-00000001"
    saved.mkdir(parents=True)
    write_lock(tmp_path, this_process())
    with pytest.raises(ConfigError, match="in use by another dtrain run"):
        claim_out(argparse.Namespace(out=tmp_path, resume=False, overwrite=True))
    assert saved.is_dir()


def test_claim_out_lets_go_of_an_out_it_refuses(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        claim_out(argparse.Namespace(out=tmp_path, resume=False, overwrite=False))
    assert not (tmp_path / LOCK_NAME).exists()
    with claim_out(argparse.Namespace(out=tmp_path, resume=True, overwrite=False)):
        assert (tmp_path / LOCK_NAME).is_file()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.timeout(300)
def test_a_second_demo_into_a_busy_out_is_refused_before_it_trains(tmp_path: Path) -> None:
    out = tmp_path / "run"
    demo = ("demo", "--model", "mlp", "--steps", "2", "--checkpoint-every", "1", "--out", str(out))
    gone = gone_process()
    write_lock(out, gone)
    after_crash = run_cli(*demo, cwd=tmp_path, timeout=280)
    assert after_crash.returncode == 0, after_crash.stderr[-3000:]
    assert f"pid {gone.pid} on host {gone.host}" in after_crash.stderr
    assert not (out / LOCK_NAME).exists()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step-00000001", "step-00000002"]

    running = this_process()  # stands for a run in progress there
    write_lock(out, running)
    second = run_cli(*demo, "--overwrite", cwd=tmp_path, timeout=280)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"in use by another dtrain run (pid {running.pid} on host {running.host}" in (
        second.stderr
    )
    assert "Traceback" not in second.stderr and "dtrain demo:" not in second.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == saved
    assert out_lock._read(out / LOCK_NAME) == running
