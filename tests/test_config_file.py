"""`--config FILE.toml`: the file's values reach Config and the demo's training options,
the command line overrides them, and every mistake names the key, the file and its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from dtrain.cli import build_parser, main
from dtrain.config.file import parse_with_config
from dtrain.demo import script as demo
from dtrain.errors import ConfigError
from dtrain.launcher.topology_flags import config_from


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def parse(*argv: str):
    return parse_with_config(build_parser(), list(argv))


def refused(tmp_path: Path, text: str, command: str = "demo") -> str:
    """The ConfigError message for a file holding `text`, given to `dtrain COMMAND`."""
    path = write(tmp_path, text)
    script = ["train.py"] if command == "run" else []
    with pytest.raises(ConfigError) as info:
        parse(command, "--config", str(path), *script)
    return str(info.value)


def test_the_command_line_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'strategy = "zero2"\nnproc = 2\n')
    args = parse("run", "--config", str(path), "--nproc", "4", "train.py", "--lr", "1")
    config = config_from(args)
    assert (config.strategy, config.nproc) == ("zero2", 4)
    assert args.script == "train.py" and args.script_args == ["--lr", "1"]
    config = config_from(parse("run", "--config", str(path), "train.py"))
    assert (config.strategy, config.nproc) == ("zero2", 2)


def test_after_the_script_config_belongs_to_the_script(tmp_path: Path) -> None:
    args = parse("run", "train.py", "--config", str(tmp_path / "absent.toml"))
    assert args.config is None and args.script_args == ["--config", str(tmp_path / "absent.toml")]


def test_dashes_underscores_arrays_and_switches(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "grad-accumulation = 2\nsplit_points = 'layers.2,layers.4'\n"
        'devices = [0, 1]\nblocks = ["Block", "Mlp"]\ncpu = true\nmemory_report = false\n'
        "timeout = 30\nstaleness-aware-lr = true\n",
    )
    args = parse("demo", "--config", str(path))
    assert args.grad_accumulation == 2
    assert args.split_points == ["layers.2", "layers.4"]
    assert args.devices == [0, 1]
    assert args.blocks == ["Block", "Mlp"]
    assert args.cpu is True and args.memory_report is False
    assert args.timeout_s == 30.0 and args.staleness_lr is True
    config = config_from(parse("demo", "--config", str(write(tmp_path, 'devices = "0,2"\n'))))
    assert config.devices == [0, 2]


def test_training_keys_reach_the_demo_workers_parser(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'model = "mlp"\nglobal_batch_size = 32\nlr = 0.05\nout = "runs/x"\nresume = true\n',
    )
    args = demo.parse_args(["--config", str(path), "--lr", "0.2"])
    assert (args.model, args.global_batch_size, args.lr) == ("mlp", 32, 0.2)
    assert args.out == Path("runs/x") and args.resume is True
    assert args.epochs == 12  # the model's default still fills what neither one set


def test_configs_own_validation_still_applies(tmp_path: Path) -> None:
    path = write(tmp_path, "nproc = 0\n")
    with pytest.raises(ConfigError, match="--nproc must be at least 1, got 0"):
        config_from(parse("demo", "--config", str(path)))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.toml does not exist; check the path"):
        parse("demo", "--config", str(tmp_path / "absent.toml"))


def test_a_toml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    message = refused(tmp_path, "# topology\nnproc = 2\nstrategy = ddp\n")
    assert "job.toml is not valid TOML" in message and "line 3" in message


def test_an_unknown_key_names_its_line_and_close_matches(tmp_path: Path) -> None:
    message = refused(tmp_path, "nproc = 2\n  nprocs = 2\n")
    assert "Unknown key 'nprocs'" in message and "job.toml, line 2" in message
    assert "Did you mean nproc" in message
    message = refused(tmp_path, "zzzz = 1\n")
    assert "The known keys are:" in message and "global-batch-size" in message
    message = refused(tmp_path, '"global-batch-size" = 32\n', "run")
    assert "Unknown key 'global-batch-size'" in message and "line 1" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('nproc = "two"', "'nproc' in {file}, line 2 must be an integer, but it is a string"),
        ("cpu = 1", "'cpu' in {file}, line 2 must be true or false, but it is an integer"),
        ('model = "resnet"', "'model' in {file}, line 2 must be one of cnn, mlp, gpt"),
        ('lr = "fast"', "'lr' in {file}, line 2 must be a number"),
        ("nproc = 2.5", "'nproc' in {file}, line 2 must be an integer, but it is a float"),
        ("devices = [true]", "'devices' in {file}, line 2 must be an array of names or int"),
        ('devices = "a,b"', "'devices' in {file}, line 2: expected GPU indices like 0,1,3"),
        ("out = 3", "'out' in {file}, line 2 must be a string"),
    ],
)
def test_a_wrong_value_names_the_key_file_line_and_type(
    tmp_path: Path, text: str, expected: str
) -> None:
    message = refused(tmp_path, f"# comment\n{text}\n")
    assert expected.format(file=tmp_path / "job.toml") in message


@pytest.mark.parametrize("text", ["[topology]\nnproc = 2\n", "topology.nproc = 2\n"])
def test_tables_are_refused(tmp_path: Path, text: str) -> None:
    message = refused(tmp_path, text)
    assert "'topology' in" in message and "line 1" in message and "flat keys only" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('config = "other.toml"', "would name another config file"),
        ('script = "train.py"', "is not a flag but the command line's SCRIPT"),
        ('script_args = "--lr 1"', "is not a flag but the command line's ARGS"),
        ("module = true", "is the short switch -m"),
    ],
)
def test_config_and_command_line_arguments_are_refused(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert expected in refused(tmp_path, text + "\n", "run")


def test_one_flag_given_twice_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "grad-accumulation = 2\ngrad_accumulation = 3\n")
    assert "both set --grad-accumulation" in message


def test_main_prints_the_error_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, 'nproc = "two"\n')
    assert main(["demo", "--config", str(path)]) == 2
    assert "dtrain: error: 'nproc' in" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_demo_trains_with_the_files_options(tmp_path: Path) -> None:
    write(tmp_path, 'strategy = "single"\nmodel = "mlp"\nglobal-batch-size = 32\nlr = 0.05\n')
    proc = run_cli(
        "demo", "--config", "job.toml", "--steps", "2", "--out", "out",
        "--metrics-json", "m.json", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["model"], metrics["global_batch_size"]) == ("mlp", 32)
    assert metrics["learning_rate"] == 0.05 and metrics["steps"] == 2
