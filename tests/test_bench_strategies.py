"""`dtrain bench --strategies ... --nproc ...`: a small real run writes its table, plots and
logs; without matplotlib the table is still written and the missing extra named; bad
flags and impossible layouts are refused in words; a trial past its --timeout is stopped
with its workers; the rows' medians and breakdown columns come from the trials' JSON."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_cli_fast import cli_without_torch

from dtrain import cli
from dtrain.bench import plots, proctree, strategies
from dtrain.bench.table import (
    PHASES,
    add_scaling_efficiency,
    read_rows,
    summarise,
    throughput_basis,
)
from dtrain.bench.trial import TrialResult, Workload, run_trial
from dtrain.cli.parser import build_parser

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GRID = ["--model", "mlp", "--strategies", "single,ddp", "--nproc", "1,2"]


@pytest.mark.timeout(150)
def test_a_small_run_writes_the_table_plots_and_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    trials: list[TrialResult] = []

    def recorded(*args: object, **kwargs: object) -> TrialResult:
        trials.append(run_trial(*args, **kwargs))  # type: ignore[arg-type]
        return trials[-1]

    monkeypatch.setattr(strategies, "run_trial", recorded)
    out = tmp_path / "bench"
    argv = ["bench", *GRID, "--steps", "3", "--repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    shown = capsys.readouterr().out
    assert "[1/3] single x1 (repeat 1/1): " in shown and "[3/3] ddp x2 (repeat 1/1): " in shown

    with (out / "bench.csv").open() as f:
        rows = {(r["strategy"], r["processes"]): r for r in csv.DictReader(f)}
    assert list(rows) == [("single", "1"), ("single", "2"), ("ddp", "1"), ("ddp", "2")]
    assert rows[("single", "2")]["status"] == "skipped"
    assert "runs in one process" in rows[("single", "2")]["note"]
    for key in (("single", "1"), ("ddp", "1"), ("ddp", "2")):
        row = rows[key]
        assert row["status"] == "ok" and row["trials"] == "1/1", row
        assert float(row["samples_per_second"]) > 0 and float(row["step_seconds"]) > 0
        # one trial: its figure is the median, the min and the max
        assert row["samples_per_second_min"] == row["samples_per_second"]
    assert float(rows[("ddp", "1")]["scaling_efficiency"]) == 1.0

    document = json.loads((out / "bench.json").read_text())
    assert document["command"].startswith("dtrain bench --model mlp")
    assert document["machine"]["cpu_cores"] >= 1
    ddp2 = next(r for r in document["rows"] if (r["strategy"], r["processes"]) == ("ddp", 2))
    assert len(ddp2["model_state_mib_per_rank"]) == 2 and ddp2["model_state_mib"] > 0
    if proctree.available():
        assert len(ddp2["peak_rss_mib_per_rank"]) == 2
        assert all(mib > 50 for mib in ddp2["peak_rss_mib_per_rank"])  # torch alone is more
    has_breakdown = ddp2["data"] is not None
    expected = ["samples_per_second.png", "scaling_efficiency.png", "memory.png"]
    expected += ["breakdown.png"] if has_breakdown else []
    for name in expected:
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE), name
    assert (out / "breakdown.png").exists() == has_breakdown
    assert len(list((out / "logs").glob("*.log"))) == 3

    # The same trials again, with matplotlib gone: the table is written, the extra named.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    replay = iter(trials)
    monkeypatch.setattr(strategies, "run_trial", lambda *a, **k: next(replay))
    bare = tmp_path / "bare"
    argv = ["bench", *GRID, "--repeats", "1", "--out", str(bare)]
    assert cli.main(argv) == 0
    shown = capsys.readouterr().out
    assert "pip install 'dtrain[plots]'" in shown
    assert [r.label for r in read_rows(bare / "bench.json")] == [
        "single x1", "single x2", "ddp x1", "ddp x2"
    ]  # fmt: skip
    assert (bare / "bench.csv").is_file() and not list(bare.glob("*.png"))


def test_the_header_counts_the_configurations_the_table_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failed(
        workload: Workload, strategy: str, nproc: int, repeat: int, **_: object
    ) -> TrialResult:
        return TrialResult(strategy, nproc, repeat, "failed", 1.0, note="planted")

    monkeypatch.setattr(strategies, "run_trial", failed)
    out = tmp_path / "bench"
    assert cli.main(["bench", *GRID, "--repeats", "2", "--out", str(out)]) == 1
    header = capsys.readouterr().out.splitlines()[1]
    assert len(read_rows(out / "bench.json")) == 4  # single x2 skipped, a row all the same
    assert header == "4 configuration(s), 1 skipped: 3 x 2 repeat(s) = 6 trials, taken in turn"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--strategies", "single,warp"], "Unknown strategy 'warp'. Known strategies: single,"),
        (
            ["--strategies", "single,towers", "--nproc", "2"],
            "None of the configurations can run: single x2: Strategy 'single' runs in one process",
        ),
        (["--strategies", "ddp", "--nproc", "1,0"], "'0' is not one."),
        (["--strategies", "ddp", "--hosts", "a:2,b:2"], "--nproc sets how many processes"),
        (["--strategies", "ddp", "--hosts", "a,a"], "lists a machine more than once"),
        (["--strategies", "ddp", "--ssh-port", "2222"], "give --hosts too"),
        (
            ["--strategies", "hsdp", "--nproc", "1", "--hosts", "a,b,c"],
            "at least 2 and divide the 3 processes",
        ),
        (["--strategies", "ddp", "--nproc", "2", "--global-batch-size", "3"], "does not divide"),
        (["--nproc", "2"], "give --strategies, e.g. --strategies single,ddp"),
        (["--strategies", "zero3 --cpp 2"], "entry 'zero3 --cpp 2' gives --cpp 2, which an"),
        (["--strategies", "zero3 --cp 2", "--nproc", "3"], "--cp 2 does not divide the 3"),
    ],
)
def test_bad_flags_and_impossible_layouts_are_refused_in_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert cli.main(["bench", *extra, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bench.csv").exists()


def test_help_and_flag_errors_answer_without_torch(tmp_path: Path) -> None:
    proc = cli_without_torch(tmp_path, "bench", "--help")
    assert proc.returncode == 0 and "--strategies STRATEGIES" in proc.stdout
    proc = cli_without_torch(tmp_path, "bench", "--strategies", "ddp", "--repeats", "0")
    assert proc.returncode == 2 and "--repeats must be at least 1" in proc.stderr


@pytest.mark.timeout(90)
def test_a_trial_past_its_timeout_is_stopped_with_its_workers(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            time.sleep(120)
            """
        )
    )
    workload = Workload(model=None, script=script)
    log = tmp_path / "logs" / "ddp.log"
    start = time.perf_counter()
    result = run_trial(workload, "ddp", 2, 0, seed=0, timeout=8, log_path=log)
    assert time.perf_counter() - start < 40
    assert result.status == "timeout" and "--timeout of 8 s" in result.note
    assert log.read_text().startswith("$ ")
    if proctree.available():
        # The launcher was watched; its workers too where they had started in time (some
        # 5 s on an idle 2-core machine). Whatever ran the script is gone now.
        assert result.peak_rss_bytes is not None
        time.sleep(0.5)
        assert not [p for p in proctree.descendants(1) if _runs(p, str(script))]
    row = summarise("ddp", 2, [result], "run")
    assert row.status == "failed" and row.samples_per_second is None and "timeout" in row.note


def _runs(pid: int, text: str) -> bool:
    try:
        return text in (proctree.PROC / str(pid) / "cmdline").read_text()
    except OSError:
        return False


def _trial(nproc: int, repeat: int, rate: float, step: float) -> TrialResult:
    """A trial's result as run_trial builds it from a metrics JSON with a breakdown."""
    ranks = [dict.fromkeys(PHASES[:5], step / 8) for _ in range(nproc)]
    ranks[-1]["communication"] = step / 4  # the last rank waits longer
    for parts in ranks:  # the parts add up to the step, as in the metrics JSON
        parts |= {"other": step - sum(parts.values()), "step": step}
    metrics = {
        "samples_per_second": rate,
        "global_batch_size": 64,
        "breakdown": ranks,
        "diagnosis": [{"cause": "communication", "rank": None, "message": "t2 > t1"}],
        "memory": [
            {"rank": r, "parameters": 2**20, "gradients": 2**20, "optimizer": 0}
            for r in range(nproc)
        ],
    }
    return TrialResult("ddp", nproc, repeat, "ok", 1.0, metrics, [2**30] * nproc)


def test_rows_take_medians_and_the_breakdown_mean_over_ranks(tmp_path: Path) -> None:
    ones = [_trial(1, r, 1000.0 + r, 0.064 / (1 + r)) for r in range(3)]
    twos = [_trial(2, 0, 1500.0, 0.04), _trial(2, 1, 1700.0, 0.05)]
    assert throughput_basis(ones + twos) == "steady"
    assert throughput_basis([*ones, replace(ones[0], metrics={"samples_per_second": 1.0})]) == "run"
    one, two = summarise("ddp", 1, ones, "run"), summarise("ddp", 2, twos, "run")
    assert (one.samples_per_second, one.samples_per_second_min) == (1001.0, 1000.0)
    # the breakdown is the median trial's (the lower of two): its parts add up to its step
    assert two.samples_per_second == 1600.0 and two.step_seconds == pytest.approx(0.04)
    assert sum(getattr(two, phase) for phase in PHASES) == pytest.approx(0.04)
    # rank 0 waits 0.04/8 per step, rank 1 0.04/4: the row shows their mean
    assert two.communication == pytest.approx((0.04 / 8 + 0.04 / 4) / 2)
    assert len(two.breakdown_per_rank) == 2 and two.diagnosis == "communication"
    assert two.model_state_mib == 2.0 and two.peak_rss_mib == 1024.0
    # steady: the global batch (64) over each trial's step time, then the median
    one, two = summarise("ddp", 1, ones, "steady"), summarise("ddp", 2, twos, "steady")
    assert one.samples_per_second == pytest.approx(64 / 0.032)
    assert one.samples_per_second_max == pytest.approx(64 / (0.064 / 3))
    assert two.samples_per_second == pytest.approx((64 / 0.04 + 64 / 0.05) / 2)
    assert one.run_samples_per_second == 1001.0
    add_scaling_efficiency([one, two])
    assert two.scaling_efficiency == pytest.approx(1440 / (2 * 2000))
    if importlib.util.find_spec("matplotlib") is not None:
        written, missing = plots.draw([one, two], tmp_path, "synthetic", "steady")
        assert not missing and (tmp_path / "breakdown.png").read_bytes().startswith(PNG_SIGNATURE)
        assert len(written) == 4


def test_trials_across_hosts_start_every_machine_with_its_processes(tmp_path: Path) -> None:
    """With --hosts, a trial is one `-H` job (its --nproc processes on each machine, over
    ssh with the bench's ssh flags), and its row counts every machine's processes."""
    args = build_parser().parse_args(
        ["bench", "--strategies", "ddp", "--hosts", "a,b", "--ssh-port", "2222"]
    )
    workload = Workload.from_args(args)
    command = workload.command("ddp", 2, 0, tmp_path)
    at = command.index("-H")
    assert command[at : at + 4] == ["-H", "a:2,b:2", "--ssh-port", "2222"]
    assert "--nproc" not in command
    workload.check("ddp", 2)  # 4 processes: the default global batch of 64 divides


def test_an_entry_runs_with_its_own_topology_flags(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "--model", "gpt", "--strategies", "x"])
    workload = Workload.from_args(args)
    command = workload.command("zero3 --cp 2", 2, 0, tmp_path)
    at = command.index("--strategy")
    assert command[at : at + 6] == ["--strategy", "zero3", "--cp", "2", "--nproc", "2"]
    workload.check("zero3 --cp 2", 2)  # the sequence cut in two: a dp of 1 takes the batch


def test_an_earlier_benchs_results_are_never_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bench.json").write_text("{}")
    assert cli.main(["bench", *GRID, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} already holds an earlier bench's results" in capsys.readouterr().err
    assert (tmp_path / "bench.json").read_text() == "{}"
