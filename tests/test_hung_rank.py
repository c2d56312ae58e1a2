"""A rank that hangs is named, with the line it hung on, within about one --timeout; a
rank that finished early, leaving the others waiting, is named as finished.

The other rank's collective times out; the agent stops the hung rank with SIGTERM, on
which it writes its stack (a SIGSTOPped rank is continued first so that it can), and the
launcher shows where it was."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from dtrain.launcher.failures import format_failures
from dtrain.launcher.stacks import stopped_workers_continued, where

HANGS = """\
import os, signal, time
import torch, torch.nn.functional as F
import dtrain
engine = dtrain.init()
model = torch.nn.Linear(4, 2)
model, opt = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
for step, batch in enumerate(engine.dataloader(data, batch_size=8)):
    if step == 2 and engine.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP); time.sleep(600)  # line 10: hangs here
    engine.train_step(batch, F.cross_entropy)
engine.close()
"""

LEAVES = HANGS.replace(
    "os.kill(os.getpid(), signal.SIGSTOP); time.sleep(600)  # line 10: hangs here",
    "raise SystemExit(0)",
)

DUMP = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait

Current thread 0x00007f0000000001 (most recent call first):
  File "train.py", line 10 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/x/dtrain/launcher/bootstrap.py", line 40 in run_target
"""


def test_where_shows_the_main_thread_without_the_launchers_frames() -> None:
    assert where(DUMP) == '  File "train.py", line 10 in <module>'


def test_a_stopped_child_with_sigterm_pending_is_continued() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        os.kill(child.pid, signal.SIGTERM)  # pending: a stopped process cannot take it
        with stopped_workers_continued(interval_s=0.05):
            assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(240)
def test_a_hung_rank_is_named_with_its_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HANGS)
    start = time.monotonic()
    done = run_cli(
        "run", "--strategy", "ddp", "--nproc", "2", "--cpu", "--timeout", "10",
        "--out", str(tmp_path / "out"), str(script), cwd=tmp_path, timeout=200,
    )  # fmt: skip
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Rank 0" in out and "waited longer than --timeout" in out, out
    # The cause leads: the rank that hung, then the rank that timed out waiting for it.
    named = "Rank 1 hung: rank 0 waited longer than --timeout for it, and it was still"
    assert named in out, out
    hung = out.index(named)
    assert hung < out.index("Rank 0 ("), out
    # Line 10, where it stopped. SIGTERM may land on another of its threads, and the main
    # thread, continued, runs on while faulthandler reads its frames (a stack read while it
    # changes can come out cut short): the sleep on the same line keeps it in place.
    assert re.search(r'train\.py", line 10 in <module>', out), out
    assert "SIGKILL" not in out, out
    print(f"named after {took:.1f} s (--timeout 10)")


@pytest.mark.timeout(240)
def test_a_rank_that_finished_early_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LEAVES)
    done = run_cli(
        "run", "--strategy", "ddp", "--nproc", "2", "--cpu", "--timeout", "10",
        "--out", str(tmp_path / "out"), str(script), cwd=tmp_path, timeout=200,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    # Rank 0 either waits out --timeout or sees rank 1's connection close as it exits:
    # which comes first depends on the machine's load.
    assert "waited longer than --timeout" in out or "Connection closed by peer" in out, out
    assert "Rank(s) 1 had already finished their script (exit code 0)" in out, out


def test_ranks_stopped_without_a_stack_are_listed_in_one_line() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {
        r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file="")
        for r, code in ((0, 1), (1, -signal.SIGTERM), (2, -signal.SIGTERM))
    }
    timed_out = "RuntimeError: [unbound_buffer.cc:81] Timed out waiting 10000ms for recv"
    failures[0].error_file_data = {
        "dtrain": {"message": timed_out, "traceback": timed_out, "user_error": False}
    }
    text = format_failures(failures, stacks={1: DUMP})
    assert "Rank 1 hung: rank 0 waited" in text and "train.py" in text
    assert "Rank(s) 2 were stopped by the launcher after that." in text


def test_a_stopped_rank_whose_main_thread_ran_on_into_an_error_still_hung() -> None:
    """Continued from SIGSTOP, the stopped rank's main thread can reach a collective with
    the rank already gone (while another thread writes the stack) and exit with that
    error before SIGTERM ends it: its stack says it was stopped, so it is named as hung."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {
        r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file="") for r in (0, 1)
    }
    timed_out = "RuntimeError: [unbound_buffer.cc:81] Timed out waiting 10000ms for recv"
    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:20710"
    for rank, error in ((0, timed_out), (1, closed)):
        failures[rank].error_file_data = {
            "dtrain": {"message": error, "traceback": error, "user_error": False}
        }
    text = format_failures(failures, stacks={1: DUMP})
    assert text.startswith("Rank 1 hung: rank 0 waited longer than --timeout for it"), text
    assert "Connection closed by peer" not in text
