"""Every malformed invocation is refused before any process starts, in one sentence that
says what was wrong and the allowed values (exit code 2, no traceback); inputs that work
still reach the launcher."""

from __future__ import annotations

import os
import socket
import zipfile
from pathlib import Path

import pytest
from conftest import run_cli

from dtrain import cli
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.launcher import runner
from dtrain.launcher.addressing import check_port_free

BAD = [
    (["demo", "--lr", "-1"], "--lr must be a finite number >= 0, got -1.0; use a rate such as"),
    (["demo", "--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["demo", "--timeout", "inf"], "--timeout must be a number of seconds above 0 and at most"),
    (["demo", "--timeout", "1e300"], "at most 604800 (a week), got 1e+300"),
    (["demo", "--timeout", "nan"], "--timeout must be a number of seconds above 0"),
    (
        ["run", "--nnodes", "2", "--master", "127.0.0.1:99999", "x.py"],
        "--master must be HOST:PORT with a port from 1 to 65535, got '127.0.0.1:99999'",
    ),
    (["run", "--ssh-port", "0", "x.py"], "--ssh-port must be a port from 1 to 65535, got 0"),
    (["run", "--nnodes", "0", "x.py"], "--nnodes must be at least 1, got 0."),
    (["demo", "--steps", "0"], "--steps must be at least 1, got 0; give the optimizer step"),
    (["demo", "--steps", "-5"], "--steps must be at least 1, got -5"),
    (["demo", "--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["demo", "--epochs", "-2"], "--epochs must be at least 1, got -2"),
    (["demo", "--checkpoint-every", "-1"], "--checkpoint-every must be at least 1, got -1"),
    (["demo", "--ref-batch-size", "0"], "--ref-batch-size must be at least 1, got 0"),
    (["demo", "--warmup-epochs", "-1"], "--warmup-epochs must be a finite number >= 0, got -1.0"),
    (["demo", "--out", ""], "--out names no path (it is ''); give one such as runs/exp1"),
    (["demo", "--out", "a_file"], "--out a_file is a file; give a directory"),
    (["demo", "--out", "a_file/sub"], "--out a_file/sub cannot be created: "),
    (["run", "--metrics-json", "a_dir", "x.py"], "--metrics-json a_dir is a directory; give the"),
    (["run", "--trace", "", "x.py"], "--trace names no path"),
    (["demo", "--stratgy", "ddp"], "dtrain demo has no flag --stratgy (did you mean --strategy?)"),
    (["run", "--stratgy=ddp", "x.py"], "dtrain run has no flag --stratgy (did you mean --strat"),
    (["demo", "--nprc", "2", "--zzz"], "has no flags --nprc (did you mean --nproc?), --zzz; fix"),
    (["run", "a_dir"], "a_dir is a directory, not a script; give the Python file to run"),
    (["run", "prog.bin"], "prog.bin is a binary file, not a Python script"),
    (["run", "-m", "no_such_module"], "no module or package no_such_module is installed"),
    (["run", "-m", "pkg.missing"], "the package pkg has no module missing."),
    (["run", "-m", "pkg"], "pkg is a package without a __main__ module"),
    (["run", "-m", "train.py"], "train is a module, not a package, so it holds no py."),
    (["run", "-m", "./train"], "that is not a dotted module name"),
]

CONFIG_FILES = [
    ("demo", "timeout = inf\n", "--timeout must be a number of seconds above 0"),
    ("demo", "steps = 0\n", "--steps must be at least 1, got 0"),
    ("demo", "lr = -0.5\n", "--lr must be a finite number >= 0, got -0.5"),
    ("demo", 'out = ""\n', "--out names no path"),
    ("run", 'nnodes = 2\nmaster = "h:70000"\n', "with a port from 1 to 65535, got 'h:70000'"),
]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A current directory holding a file, a directory, a binary file, a script and a
    package (without __main__); launching anything from it fails the test."""
    (tmp_path / "a_file").write_text("not a directory\n")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "prog.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64))
    (tmp_path / "train.py").write_text("print('trained')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("print('trained')\n")
    monkeypatch.chdir(tmp_path)
    launched: list[runner.Target] = []
    monkeypatch.setattr(runner, "launch", lambda config, target: launched.append(target))
    return tmp_path


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What `dtrain ARGV` prints on stderr, asserting it exits with code 2 unlaunched."""
    assert cli.main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_flags_and_paths_are_refused_by_name(
    workdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = refusal(argv, capsys)
    assert err.startswith("dtrain: ") and message in err, err


@pytest.mark.parametrize(("command", "text", "message"), CONFIG_FILES)
def test_bad_values_in_a_config_file_are_refused_by_name(
    workdir: Path, capsys: pytest.CaptureFixture[str], command: str, text: str, message: str
) -> None:
    (workdir / "job.toml").write_text(text)
    script = ["x.py"] if command == "run" else []
    assert message in refusal([command, "--config", "job.toml", *script], capsys)


def test_an_unwritable_out_is_refused(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root every directory is writable, so the refusal of access is simulated."""
    access = os.access
    locked = Path.cwd() / "a_dir"
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw)
    )
    err = refusal(["run", "--out", "a_dir/new/deeper", "train.py"], capsys)
    assert f"--out a_dir/new/deeper cannot be written: this user may not write to {locked}" in err


def test_runnable_targets_reach_the_launcher(workdir: Path) -> None:
    """Modules found as python -m finds them, packages whose __init__ extends __path__
    (found only by importing them), compiled and zipped scripts all pass the checks."""
    (workdir / "ns").mkdir()
    (workdir / "ns" / "__init__.py").write_text(
        "import pkgutil\n__path__ = pkgutil.extend_path(__path__, __name__)\n"
    )
    with zipfile.ZipFile(workdir / "app.pyz", "w") as archive:
        archive.writestr("__main__.py", "print('trained')\n")
    for argv in (
        ["run", "train.py"],
        ["run", "-m", "pkg.train"],
        ["run", "-m", "json.tool"],
        ["run", "-m", "ns.elsewhere"],
        ["run", "app.pyz"],
        ["run", "--out", "runs/new", "--metrics-json", "runs/new/m.json", "train.py"],
    ):
        assert cli.main(argv) == 0, argv


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--lr", "-1"], "--lr must be a finite number >= 0"),
        (["run", "--nnodes", "2", "--master", "127.0.0.1:99999", "x.py"], "from 1 to 65535"),
        (["run", "-m", "no_such_module"], "There is no module no_such_module to run with -m"),
        (["demo", "--stratgy", "ddp"], "did you mean --strategy?"),
    ],
)
def test_the_command_answers_in_one_paragraph(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    done = run_cli(*argv, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("dtrain: ") and message in done.stderr
    assert "Traceback" not in done.stderr and "\n\n" not in done.stderr.strip()


def test_a_port_in_time_wait_is_free_and_a_listened_one_is_not() -> None:
    with socket.socket() as listener:
        # the rendezvous's store listens with SO_REUSEADDR; its accepted sockets inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the side that closes first, on `port`, ends in TIME-WAIT
        assert client.recv(1) == b""
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # the TIME-WAIT socket is there: a bind without reuse fails
    check_port_free(port)
    with socket.socket() as live:
        live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        live.bind(("", port))
        live.listen()
        with pytest.raises(ConfigError, match=f"Port {port} is already in use on this machine"):
            check_port_free(port)


def test_a_config_built_in_process_is_checked_too() -> None:
    """dtrain.init(**options) builds its Config as the command line does."""
    with pytest.raises(ConfigError, match="--timeout must be a number of seconds"):
        Config(timeout_s=float("inf"))
    with pytest.raises(ConfigError, match="--master must be HOST:PORT"):
        Config(nnodes=2, master="head:\N{SUPERSCRIPT TWO}")  # a digit to isdigit, not to int
