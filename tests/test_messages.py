"""What a person reads: advice that speaks to the command that is running (`dtrain run`,
`dtrain demo`, `dtrain.launch`, `horovodrun`), and output that reads cleanly: one
``[rank N]`` per line, progress in log files as whole lines, bench headers whole, a table
of the trials done when a bench is interrupted, the memory report on the console, and an
Engine that closes fully after a failed background save. All in this process, but for
one trial of `dtrain bench` stopped by Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtrain
from dtrain import advice, cli
from dtrain.bench import strategies
from dtrain.bench.table import PHASES, Row, format_rows, read_rows
from dtrain.bench.trial import TrialResult, run_trial
from dtrain.checkpoint.format import check_fit
from dtrain.errors import CheckpointError, NonFiniteLossError, Stopped
from dtrain.launcher import forked, notebook
from dtrain.launcher import runner as launch_runner
from dtrain.models.digits import DigitsMLP
from dtrain.observe.diagnosis import diagnose
from dtrain.observe.progress import Throughput, track

SCRIPT = """
import sys
from dtrain import advice
from dtrain.errors import NonFiniteLossError

with open(sys.argv[1], "w") as f:
    f.write(f"{advice.running()}\\n{NonFiniteLossError(3, float('nan'))}")
"""


def _messages() -> dict[str, str]:
    """Each advice-bearing message, as the running command words it now."""
    try:
        check_fit({"w": torch.Size([2])}, {"v": torch.zeros(2)})
    except CheckpointError as e:
        misfit = str(e)
    return {
        "nan": str(NonFiniteLossError(3, float("nan"))),
        "stopped": str(Stopped(signal.SIGINT)),
        "misfit": misfit,
        "restart": advice.after_restart(),
    }


def test_each_message_speaks_to_the_command_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(advice.COMMAND_VAR, raising=False)
    plain = _messages()  # plain python: advised as a script
    assert "Lower the learning rate the script sets" in plain["nan"]
    assert "--lr" not in plain["nan"] and "--resume" not in plain["nan"]
    assert "a script that calls engine.resume continues" in plain["stopped"]
    assert "dtrain demo" not in plain["stopped"]
    assert "pass strict=False" in plain["misfit"]
    with advice.running_as(advice.RUN):
        assert _messages() == plain
    with advice.running_as(advice.DEMO):
        demo = _messages()
    assert "Lower the learning rate (--lr)" in demo["nan"]
    assert "dtrain demo continues from the last checkpoint with --resume" in demo["nan"]
    assert "(dtrain demo continues from the last checkpoint with --resume)" in demo["stopped"]
    assert "--model and --model-size that saved it, or another --out" in demo["misfit"]
    assert "strict=False" not in demo["misfit"]
    assert demo["restart"] == "dtrain demo resumes from its last checkpoint by itself."
    with advice.running_as(advice.LAUNCH):
        launch = _messages()
    assert "the function sets" in launch["nan"]
    assert "a function that calls engine.resume" in launch["stopped"]
    with advice.running_as(advice.HOROVODRUN):
        assert "a script that loads its last checkpoint" in _messages()["stopped"]
    assert advice.COMMAND_VAR not in os.environ  # restored
    # dtrain.launch names itself to its ranks
    env = notebook._environment(dtrain.Config(), 0, 1, 1234, "1")
    assert env[advice.COMMAND_VAR] == advice.LAUNCH


def test_the_commands_name_themselves_to_their_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtrain.horovod.run import main as horovodrun

    script, said = tmp_path / "train.py", tmp_path / "said.txt"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)  # a one-process launch sets the worker's variables here
    try:
        assert cli.main(["run", "--out", str(tmp_path / "out"), str(script), str(said)]) == 0
        command, nan = said.read_text().split("\n", 1)
        assert command == "run" and "the script sets" in nan and "--lr" not in nan
        assert horovodrun(["-np", "1", "python", str(script), str(said)]) == 0
        assert said.read_text().startswith("horovodrun\n")
    finally:
        os.environ.clear()
        os.environ.update(saved)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_runner, "launch", interrupted)
    assert cli.main(["run", str(script)]) == 128 + signal.SIGINT
    assert "(a script that calls engine.resume continues" in capsys.readouterr().err
    assert cli.main(["demo", "--out", str(tmp_path / "demo")]) == 128 + signal.SIGINT
    assert "(dtrain demo continues from the last checkpoint with --resume)" in (
        capsys.readouterr().err
    )


def test_the_diagnosis_asks_for_more_accumulation_than_the_run_uses() -> None:
    chatty = dict(data=0.001, forward=0.01, backward=0.02, communication=0.05, optimizer=0.001)
    chatty["other"] = 0.001
    chatty["step"] = sum(chatty.values())
    [first, *_] = diagnose([chatty, chatty])
    assert "or use --grad-accumulation so" in first["message"]
    [first, *_] = diagnose([chatty, chatty], grad_accumulation=4)
    assert "or raise --grad-accumulation above its 4 so" in first["message"]


def test_forked_ranks_print_one_prefix_per_line() -> None:
    out = io.StringIO()
    child = forked.Child(0, 0, -1, {5: out}, {5: bytearray(b"\rA\rB\r\nC\n\rD")})
    forked._print_lines(child, 5, final=False)
    assert out.getvalue() == "[rank 0] A\r[rank 0] B\r\n[rank 0] C\n"
    forked._print_lines(child, 5, final=True)
    assert out.getvalue().endswith("[rank 0] C\n[rank 0] D\n")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress(stream: io.StringIO, steps: int, stop_at: int | None = None) -> list[int]:
    """Track `steps` items whose loss is read back only at the end (`finish`)."""
    losses = {"read": None}

    def finish() -> None:
        losses["read"] = 0.25

    seen = []
    for item in track(
        range(steps),
        total=steps,
        samples_per_item=8,
        throughput=Throughput(),
        loss=lambda: losses["read"],
        desc="epoch 0",
        enabled=True,
        finish=finish,
        stream=stream,
    ):
        seen.append(item)
        if item == stop_at:
            losses["read"] = 0.5  # as the demo reads before it breaks out
            break
    return seen


def test_progress_is_whole_lines_in_files_and_shows_the_last_loss() -> None:
    log = io.StringIO()
    assert _progress(log, 4) == [0, 1, 2, 3]
    [line] = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert line.startswith("epoch 0: 4/4 steps, loss=0.2500, ") and line.endswith("samples/s")
    log = io.StringIO()
    _progress(log, 4, stop_at=1)
    assert log.getvalue().startswith("epoch 0: 2/4 steps, loss=0.5000, ")
    terminal = _Terminal()
    _progress(terminal, 4)
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue()
    assert "loss=0.2500" in terminal.getvalue().rsplit("\r", 1)[-1]  # the final redraw
    quiet = io.StringIO()
    for _ in track(
        range(2),
        total=2,
        samples_per_item=1,
        throughput=Throughput(),
        loss=lambda: None,
        desc="x",
        enabled=False,
        stream=quiet,
    ):
        pass
    assert quiet.getvalue() == ""


def test_bench_headers_are_whole() -> None:
    row = Row("ddp", 2, "ok", "1/1", 1000.0, 900.0, 1100.0, step_seconds=0.01)
    for phase in PHASES:
        setattr(row, phase, 0.001)
    head = format_rows([row]).splitlines()[0].split()
    assert [*PHASES] == head[head.index("ms") + 1 : head.index("ms") + 1 + len(PHASES)]


def test_an_interrupted_bench_writes_the_table_of_the_trials_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = []

    def trial(workload: object, strategy: str, nproc: int, repeat: int, **_: object):
        calls.append(strategy)
        if len(calls) > 1:
            raise KeyboardInterrupt
        metrics = {"samples_per_second": 100.0, "global_batch_size": 64}
        return TrialResult(strategy, nproc, repeat, "ok", 1.0, metrics)

    monkeypatch.setattr(strategies, "run_trial", trial)
    monkeypatch.setattr(strategies, "draw_plots", lambda *_: None)
    out = tmp_path / "bench"
    argv = ["bench", "--strategies", "single,ddp", "--nproc", "1,2", "--out", str(out)]
    assert cli.main([*argv, "--repeats", "2"]) == 128 + signal.SIGINT
    shown = capsys.readouterr()
    assert "interrupted (Ctrl-C) during the trial ddp x1 (repeat 1)" in shown.err
    assert "the 1 of 6 trials done before it" in shown.err
    single, skipped, ddp1, ddp2 = read_rows(out / "bench.json")
    assert (single.label, single.status, single.samples_per_second) == ("single x1", "ok", 100)
    assert skipped.status == "skipped"
    assert ddp1.status == ddp2.status == "interrupted" and ddp2.label == "ddp x2"
    assert "interrupted" in shown.out and (out / "bench.csv").is_file()


def test_close_finishes_its_duties_before_raising_a_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.json"
    engine = dtrain.init(seed=0, memory_report=True, metrics_json=str(metrics))
    model = DigitsMLP(hidden=4)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.train_step((torch.randn(4, 64), torch.randint(0, 10, (4,))), F.cross_entropy)
    failed = CheckpointError("The background save of x failed (OSError: boom).")

    def finish() -> None:
        raise failed

    monkeypatch.setattr(engine.checkpoints, "finish", finish)
    del model
    with pytest.raises(CheckpointError) as raised:
        engine.close()
    assert raised.value is failed
    said = capsys.readouterr().out
    assert "dtrain: model state per rank" in said and "dtrain: 1 steps" in said
    assert json.loads(metrics.read_text())["steps"] == 1
    assert not dist.is_initialized()
    engine.close()  # the error was raised once


class _Sleeper:
    """A workload whose trial is one process that writes its pid, then sleeps."""

    def __init__(self, pid_file: Path) -> None:
        self.pid_file = pid_file

    def command(self, *_: object) -> list[str]:
        code = f"import os, time; open({str(self.pid_file)!r}, 'w').write(str(os.getpid()))"
        return [sys.executable, "-c", code + "; time.sleep(60)"]


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_trial_stops_its_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"

    def interrupt_once_started() -> None:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_trial(
            _Sleeper(pid_file),  # type: ignore[arg-type]
            "ddp",
            1,
            0,
            seed=0,
            timeout=50,
            log_path=tmp_path / "trial.log",
        )
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left running
        os.kill(int(pid_file.read_text()), 0)
