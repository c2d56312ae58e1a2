"""Every `dtrain` and `python` command README.md and docs/*.md show can be typed as shown.

The commands are read from the documents' shell blocks (```bash, ```console, ```sh and
unlabelled ones; ```text holds synopses), in reading order: README.md, then docs/ by name.
Each `dtrain` command line goes through dtrain's own parser and the checks the launcher
makes before anything starts, without running it; each script a command runs exists.
The commands are then followed as one session in an empty folder: a command that reads a
path (a checkpoint to inspect, verify or convert, shard files to train from) needs an
earlier command to have written it, and a `dtrain demo` may not write into an --out an
earlier one filled (it would be refused). What a command writes is put in place empty,
checkpoints at the steps the demo would save.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from dtrain.bench.bench_flags import check_args
from dtrain.checkpoint import step_path
from dtrain.checkpoint.convert import PLAIN_SUFFIXES
from dtrain.cli.parser import build_parser
from dtrain.cli.preflight import check_run
from dtrain.config.file import parse_with_config
from dtrain.datasets import load_digits
from dtrain.demo.checks import complete_args
from dtrain.demo.flags import check_training_args
from dtrain.errors import DtrainError
from dtrain.launcher.topology_flags import config_from

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("bash", "console", "sh", "shell", "")
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)
COMMAND = re.compile(r"(?:[A-Za-z_]\w*=\S*\s+)*(?:dtrain|python3?|cd)\s")
"""The start of a command this test reads (after any VAR=value)."""

READERS_OWN = {
    "train.py": "# the reader's own training script\n",
    "hosts.txt": "node-a slots=4\nnode-b slots=4\n",
    "old_ddp_run.pth": "",
}
"""Files the documents take from the reader (their own script, hostfile, an old PyTorch
checkpoint), with stand-in contents."""

REPOSITORY = ("examples", "benchmarks")
"""Folders of this repository the commands run scripts from, relative to its root."""


@dataclass(frozen=True)
class Command:
    """One command of a document: where it is shown, its words, the folder it runs in
    (relative to the session's, after a `cd` on the same line)."""

    where: str
    argv: list[str]
    cwd: str

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _lines(block: str) -> Iterator[tuple[int, str]]:
    """(offset, line) of a shell block, continued lines joined."""
    joined, start = "", 0
    for i, line in enumerate(block.splitlines()):
        if not joined:
            start = i
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        yield start, joined + line
        joined = ""


def documented_commands() -> list[Command]:
    """Every `dtrain` and `python` command of the documents' shell blocks, in order."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for block in FENCE.finditer(text):
            if block[2] not in SHELL_BLOCKS:
                continue
            first = text.count("\n", 0, block.start(3)) + 1
            for offset, line in _lines(block[3]):
                where = f"{document.relative_to(ROOT)}:{first + offset}"
                found += _commands_of(line, where)
    return found


def _commands_of(line: str, where: str) -> list[Command]:
    """The commands of one shell line: its `&&` parts, without leading VAR=value."""
    found, cwd = [], "."
    for part in re.split(r"\s*&&\s*", line.strip()):
        if not COMMAND.match(part):
            continue
        words = shlex.split(part, comments=True)
        while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["cd"]:
            cwd = os.path.normpath(os.path.join(cwd, words[1]))
        elif words[:1] in (["dtrain"], ["python"], ["python3"]):
            found.append(Command(where, words, cwd))
    return found


@cache
def _digits_per_epoch(global_batch_size: int) -> int:
    return len(load_digits()[0]) // global_batch_size


def demo_checkpoints(args: argparse.Namespace) -> list[Path]:
    """The checkpoints a `dtrain demo` of the digits leaves under its --out: one at each
    epoch's end (or every --checkpoint-every steps) and at the last step, the newest
    --keep-checkpoints of them."""
    per_epoch = _digits_per_epoch(args.global_batch_size)
    last = args.epochs * per_epoch if args.steps is None else args.steps
    every = args.checkpoint_every or per_epoch
    steps = sorted({*range(every, last + 1, every), last})[-args.keep_checkpoints :]
    return [step_path(args.out / "checkpoints", step) for step in steps]


def _parsed(command: Command) -> argparse.Namespace:
    """`command`'s arguments as dtrain reads them, checked as the launcher checks them
    before anything starts; a DtrainError or SystemExit (argparse) if it would refuse."""
    args = parse_with_config(build_parser(), command.argv[1:])
    if args.command in ("run", "demo") or getattr(args, "bench_command", None) == "comm":
        config = config_from(args)
        if args.command == "run":
            check_run(config, args)
    if args.command == "demo":
        check_training_args(args)
        complete_args(args)
    if args.command == "bench" and args.bench_command is None:
        check_args(args)
    return args


def _inside(path: Path) -> Path:
    """`path`, an absolute one taken as relative to the session's folder."""
    return Path(*path.parts[1:]) if path.is_absolute() else path


def _follow(command: Command, args: argparse.Namespace) -> str | None:
    """Check the paths `command` reads exist, and put in place the ones it writes (all
    inside the session's folder); what is wrong, or None."""
    for name in ("src", "dst", "path", "out"):
        if isinstance(getattr(args, name, None), Path):
            setattr(args, name, _inside(getattr(args, name)))
    if args.command == "ckpt":
        read = args.src if args.ckpt_command == "convert" else args.path
        if not read.exists():
            return f"it reads {read}, which no command before it writes"
        if args.ckpt_command == "convert":
            if args.dst.suffix in PLAIN_SUFFIXES:
                args.dst.touch()
            else:
                args.dst.mkdir(parents=True)
    elif args.command == "data":
        args.out.mkdir(parents=True)
        (args.out / "index.json").touch()
    elif args.command == "demo":
        if (args.out / "checkpoints").exists() and not (args.resume or args.overwrite):
            return f"--out {args.out} holds an earlier command's checkpoints, so it is refused"
        if args.model == "gpt":  # trained on text: where it saves is not worked out here
            (args.out / "checkpoints").mkdir(parents=True, exist_ok=True)
            return None
        for path in demo_checkpoints(args):
            path.mkdir(parents=True, exist_ok=True)
    elif args.command == "plan" and args.script and not Path(args.script).is_file():
        return f"its --script {args.script} does not exist"
    return None


def _script_missing(command: Command, args: argparse.Namespace | None) -> str | None:
    """What is wrong with the script a `python` or `dtrain run` command runs (`args`:
    dtrain's reading of it), or None."""
    if args is not None:
        script = args.script if args.command == "run" and not args.module else None
    else:
        script = command.argv[1] if command.argv[1:2] not in ([], ["-m"]) else None
    if script is not None and not (Path(command.cwd) / script).is_file():
        return f"its script {script} is not in this repository nor the reader's own"
    return None


def _session(folder: Path) -> None:
    """`folder` as the reader's working directory: their own files, this repository's
    scripts."""
    for name, text in READERS_OWN.items():
        (folder / name).write_text(text)
    for name in REPOSITORY:
        (folder / name).symlink_to(ROOT / name)


def test_the_commands_are_read_from_the_shell_blocks() -> None:
    shown = [shlex.join(command.argv) for command in documented_commands()]
    assert "python examples/quickstart.py" in shown
    assert "dtrain ckpt convert runs/sharded/checkpoints/step-00000264 runs/consolidated" in shown
    assert not [line for line in shown if "[TOPOLOGY]" in line]  # a synopsis, in ```text


def test_every_documented_command_parses_and_reads_what_an_earlier_one_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _session(tmp_path)
    monkeypatch.chdir(tmp_path)
    wrong = []
    for command in documented_commands():
        if command.argv[0] != "dtrain":
            problem = _script_missing(command, None)
        else:
            said = io.StringIO()
            try:
                with contextlib.redirect_stderr(said):
                    args = _parsed(command)
                problem = _script_missing(command, args) or _follow(command, args)
            except (DtrainError, SystemExit) as e:
                problem = f"dtrain refuses it: {e} {said.getvalue().strip()}"
        if problem is not None:
            wrong.append(f"{command}\n    {problem}")
    assert not wrong, "Documented commands that fail as shown:\n" + "\n".join(wrong)
