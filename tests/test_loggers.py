"""The CSV and TensorBoard metric loggers: written, read back, continued, refused."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dtrain
from dtrain.errors import ConfigError
from dtrain.observe.loggers import LOGGERS, check_loggers, open_loggers
from dtrain.process.teardown import close_all


def csv_rows(directory: Path) -> list[tuple[int, str, float]]:
    """The (step, name, value) rows of `directory/metrics.csv`, checking its header."""
    with (directory / "metrics.csv").open(newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == ["step", "name", "value"]
        return [(int(step), name, float(value)) for step, name, value in reader]


def scalars(directory: Path, name: str) -> list[tuple[int, float]]:
    """The (step, value) points of `name` as TensorBoard itself reads them."""
    events = EventAccumulator(str(directory / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(name)]


def test_csv_is_long_format_and_keeps_keys_that_appear_later(tmp_path: Path) -> None:
    logger = open_loggers(["csv"], tmp_path)
    logger.log({"train/loss": 2.5, "train/lr": 0.1}, step=1)
    logger.log({"train/loss": torch.tensor(1.5)}, step=2)
    logger.log({"eval/accuracy": 0.75, "my_metric": 3}, step=2)
    # Each call reaches the file at once: a crash after it loses nothing.
    assert csv_rows(tmp_path)[-1] == (2, "my_metric", 3.0)
    logger.close()
    assert csv_rows(tmp_path) == [
        (1, "train/loss", 2.5),
        (1, "train/lr", 0.1),
        (2, "train/loss", 1.5),
        (2, "eval/accuracy", 0.75),
        (2, "my_metric", 3.0),
    ]


def test_csv_reopened_appends_and_resume_drops_the_later_rows(tmp_path: Path) -> None:
    logger = open_loggers(["csv"], tmp_path)
    for step in range(1, 5):
        logger.log({"train/loss": float(step)}, step=step)
    logger.close()

    logger = open_loggers(["csv"], tmp_path)
    logger.log({"train/loss": 50.0}, step=5)
    logger.close()
    assert [step for step, _, _ in csv_rows(tmp_path)] == [1, 2, 3, 4, 5]

    logger = open_loggers(["csv"], tmp_path, resume_step=2)
    logger.log({"train/loss": 30.0}, step=3)
    logger.close()
    assert csv_rows(tmp_path) == [
        (1, "train/loss", 1.0),
        (2, "train/loss", 2.0),
        (3, "train/loss", 30.0),
    ]


def test_csv_drops_a_row_torn_by_a_crash(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("step,name,value\n1,train/loss,2.0\n2,train/lo")
    logger = open_loggers(["csv"], tmp_path)
    logger.log({"train/loss": 1.0}, step=3)
    logger.close()
    assert csv_rows(tmp_path) == [(1, "train/loss", 2.0), (3, "train/loss", 1.0)]


def test_tensorboard_is_read_back_by_tensorboard(tmp_path: Path) -> None:
    logger = open_loggers(["csv", "tensorboard"], tmp_path)
    logger.log({"train/loss": 2.5, "train/samples_per_second": 1000.0}, step=1)
    logger.log({"train/loss": torch.tensor(1.5, dtype=torch.float64)}, step=2)
    logger.log({"eval/accuracy": 0.75}, step=2)
    logger.close()
    assert scalars(tmp_path, "train/loss") == [(1, 2.5), (2, 1.5)]
    assert scalars(tmp_path, "eval/accuracy") == [(2, pytest.approx(0.75))]
    assert scalars(tmp_path, "train/samples_per_second") == [(1, 1000.0)]


def test_tensorboard_resume_hides_the_earlier_runs_later_points(tmp_path: Path) -> None:
    logger = open_loggers(["tensorboard"], tmp_path)
    for step in range(1, 5):
        logger.log({"train/loss": float(step)}, step=step)
    logger.close()
    logger = open_loggers(["tensorboard"], tmp_path, resume_step=2)
    logger.log({"train/loss": 30.0}, step=3)
    logger.close()
    assert scalars(tmp_path, "train/loss") == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_non_numbers_are_skipped_with_a_warning_and_non_finite_values_kept(
    tmp_path: Path,
) -> None:
    logger = open_loggers(["csv"], tmp_path)
    with pytest.warns(UserWarning, match="'note' is a str, not a number"):
        logger.log({"note": "hello", "train/grad_norm": math.inf, "train/loss": math.nan}, step=1)
    logger.close()
    rows = csv_rows(tmp_path)
    assert [name for _, name, _ in rows] == ["train/grad_norm", "train/loss"]
    assert rows[0][2] == math.inf and math.isnan(rows[1][2])


def test_no_loggers_log_nothing(tmp_path: Path) -> None:
    logger = open_loggers([], tmp_path)
    logger.log({"train/loss": 1.0}, step=1)
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_logger_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Unknown logger 'wandb': choose from csv, tensorboard"):
        check_loggers(["csv", "wandb"])
    with pytest.raises(ConfigError, match="wandb"):
        open_loggers(["wandb"], tmp_path)
    assert LOGGERS == ("csv", "tensorboard")


def test_missing_tensorboard_is_refused_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules is how Python marks a module that cannot be imported.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[tensorboard\]'"):
        check_loggers(["tensorboard"])
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[tensorboard\]'"):
        open_loggers(["csv", "tensorboard"], tmp_path)
    check_loggers(["csv"])


def test_an_engine_refused_for_missing_tensorboard_ends_on_that_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The refusal comes while the Engine is being built; the exit handler then closes
    # that half-built Engine (the traceback keeps it alive), which must add no error.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="needs the tensorboard package") as refused:
        dtrain.init(strategy="single", logger=["tensorboard"], out=str(tmp_path))
    close_all(failed=True)  # what the exit handler runs
    assert str(refused.value).endswith("or choose the csv logger.")


def test_tensorboard_that_fails_to_import_is_refused_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The package is there but torch's writer cannot load it (a protobuf clash, say).
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        ConfigError, match=r"could not be imported .*pip install 'dtrain\[tensorboard\]'"
    ):
        open_loggers(["csv", "tensorboard"], tmp_path)
    assert not (tmp_path / "metrics.csv").exists()
