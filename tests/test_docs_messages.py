"""Every message docs/troubleshooting.md quotes is one dtrain prints.

Each backticked message in the first column of the document's tables (outside the
parentheses that say which command prints it) is turned into a pattern: `...`, quoted
values ('x', "2"), numbers and capitalised placeholders (DIR, N, X) match anything, and
quotes and backticks are dropped. The pattern is looked for in the source of src/dtrain,
its string literals flattened (adjacent and continued literals joined, quotes dropped,
module constants such as ``{INDEX}`` put in), the parts between `...` in order within one
file. Messages assembled at run time (a flag name from a table, the operating system's
words for an error, a report put together from parts) are produced by the code instead,
in TRIGGERED, and matched the same way.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import io
import json
import os
import re
import signal
import socket
from collections.abc import Callable
from functools import cache
from pathlib import Path

import safetensors.torch
import torch
from conftest import run_ckpt
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import dtrain
from dtrain.checkpoint import out_lock, step_path
from dtrain.checkpoint.disk import write_failed
from dtrain.checkpoint.format import (
    FORMAT,
    MANIFEST,
    check_fit,
    file_records,
    manifest_problem,
    read_manifest,
    write_manifest,
)
from dtrain.cli.parser import build_parser
from dtrain.cli.preflight import check_run
from dtrain.config import Config
from dtrain.config.file import parse_with_config
from dtrain.demo.flags import check_training_args
from dtrain.errors import DtrainError, NonFiniteLossError
from dtrain.launcher.failures import format_failures
from dtrain.launcher.topology_flags import config_from
from dtrain.models import build
from dtrain.parallel.tensor_plan import plan_of
from dtrain.strategies.ps.protocol import Channel
from dtrain.strategies.ps.roles import Roles
from dtrain.strategies.specs import lookup

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "troubleshooting.md"
SOURCE = ROOT / "src" / "dtrain"

PLACEHOLDER = re.compile(
    r"""(?:\.\.\.|\b[A-Z][A-Z0-9]*\b)(?:[/.][\w.]+)*"""  # ..., DIR, DIR/dtrain.lock
    r"""|'[^']*'|"[^"]*"|\b\d+s?\b"""  # 'x', "2", 0, 600s
    r"""|\b[xy](?:\.py)?\b|(?<=[a-z])[A-Z]\b"""  # x, x.py, the D of dpD
)
"""What stands for a part of a message that changes."""

CONTINUED = re.compile(r"""["'`]\s*\+?\s*\n\s*[rbfuRBFU]{0,2}["']|["'] +[rbfuRBFU]{0,2}["']""")
"""The end of a string literal and the start of the next that continues it."""


def _cells(row: str) -> list[str]:
    return re.split(r"(?<!\\)\|", row.strip().strip("|"))


def _outside_parentheses(cell: str) -> list[str]:
    """The backticked spans of `cell` that are not inside parentheses."""
    spans, depth, i = [], 0, 0
    while i < len(cell):
        if cell[i] == "`":
            end = cell.index("`", i + 1)
            if depth == 0:
                spans.append(cell[i + 1 : end])
            i = end + 1
            continue
        depth += {"(": 1, ")": -1}.get(cell[i], 0)
        i += 1
    return spans


def quoted_messages() -> list[tuple[int, str]]:
    """(line, message) for every message the tables of troubleshooting.md quote."""
    found = []
    for number, line in enumerate(DOC.read_text().splitlines(), start=1):
        if line.startswith("| `"):
            found += [(number, m) for m in _outside_parentheses(_cells(line)[0])]
    return found


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\|", "|")).strip()


def _chunk_pattern(chunk: str) -> re.Pattern[str] | None:
    """The pattern of a part of a message without `...`: its placeholders match anything
    on the line, the rest literally, without quotes (None: nothing literal)."""
    literals = [re.sub(r"""["'`]""", "", part) for part in PLACEHOLDER.split(chunk)]
    while literals and not literals[0].strip():
        literals.pop(0)
    while literals and not literals[-1].strip():
        literals.pop()
    if not literals:
        return None
    literals[0], literals[-1] = literals[0].lstrip(), literals[-1].rstrip()
    return re.compile(r"[^\n]*?".join(map(re.escape, literals)))


def patterns(message: str) -> list[re.Pattern[str]]:
    """The patterns `message` is found by, in order: one per part between `...`."""
    chunks = re.split(r"\.\.\.(?:[/.][\w.]+)*", _normal(message))
    return [p for p in map(_chunk_pattern, chunks) if p is not None]


def matches(message: str, text: str) -> bool:
    """Whether `text` holds `message`'s parts in order."""
    position = 0
    for pattern in patterns(message):
        found = pattern.search(text, position)
        if found is None:
            return False
        position = found.end()
    return True


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module's constants that hold a string (``INDEX = ".metadata"``)."""
    found = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        named = isinstance(target, ast.Name) and target.id.isupper()
        if named and isinstance(value, ast.Constant) and isinstance(value.value, str):
            found[target.id] = value.value  # type: ignore[union-attr]
    return found


def _module_file(name: str) -> Path:
    path = SOURCE.parent.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@cache
def flattened_sources() -> dict[Path, str]:
    """Every module of src/dtrain, its string literals flattened: continued literals
    joined, the constants it defines or imports put in, quotes and backticks dropped."""
    texts = {path: path.read_text() for path in sorted(SOURCE.rglob("*.py"))}
    trees = {path: ast.parse(text) for path, text in texts.items()}
    constants = {path: _constants(tree) for path, tree in trees.items()}
    flat = {}
    for path, text in texts.items():
        known = dict(constants[path])
        for node in trees[path].body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtrain"):
                theirs = constants.get(_module_file(node.module or ""), {})
                known |= {a.name: theirs[a.name] for a in node.names if a.name in theirs}
        flat[path] = _flatten(text, known)
    return flat


def _flatten(text: str, constants: dict[str, str]) -> str:
    """`text` with its continued literals joined, `constants` put in where an f-string
    names them, quotes and backticks dropped."""
    text = re.sub(r"\{([A-Z][A-Z0-9_]*)\}", lambda m: constants.get(m[1], m[0]), text)
    text = re.sub(r"""["'`]""", "", CONTINUED.sub("", text))
    return re.sub(r"[ \t]+", " ", text)


def in_source(message: str) -> bool:
    """Whether some module of src/dtrain holds `message`'s parts in order."""
    return any(matches(message, text) for text in flattened_sources().values())


def _refusal(*argv: str) -> str:
    """The refusal of a command line, as the launcher makes it before any process starts
    (parsing, --config, the Config's rules, the demo's and the script's checks, the
    strategy's own), without starting anything."""
    args = parse_with_config(build_parser(), list(argv))
    config = config_from(args)
    if args.command == "demo":
        check_training_args(args)
    else:
        check_run(config, args)
    spec = lookup(config.strategy)
    spec.check_launch(config)
    spec.check_options(config)
    raise AssertionError(f"dtrain {' '.join(argv)} was not refused.")


def _from_file(tmp: Path, toml: str) -> str:
    (tmp / "job.toml").write_text(toml)
    return _refusal("demo", "--config", str(tmp / "job.toml"))


class _Work:
    """A send or receive that gloo ends with `error`."""

    def __init__(self, error: str) -> None:
        self.error = error

    def wait(self, timeout: object) -> None:
        raise RuntimeError(self.error)


def _ps_wait(what: str, peer: int | None, error: str) -> str:
    """A worker's (or server's) message about `what`, a message to or from global rank
    `peer` of a job of 2 workers and 1 server that gloo ended with `error`."""
    roles = Roles.of(Config(strategy="ps", nproc=2, servers=1))
    Channel(None, roles, rank=0).wait(_Work(error), 600, what, peer)  # type: ignore[arg-type]
    raise AssertionError("The wait did not fail.")


TIMED_OUT = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms for recv"
STOPPED_HERE = """Current thread 0x00007f0000000001 (most recent call first):
  File "train.py", line 10 in <module>
"""
WAITED = (
    f'Traceback (most recent call last):\n  File "train.py", line 11\nRuntimeError: {TIMED_OUT}'
)
CLOSED = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:6558"


def _failures(stopped: int, by: int) -> str:
    """The launcher's report of rank 0 ending with `by` (an exit code, or minus a signal)
    while rank 1 was stopped with `stopped`, where rank 1 stood."""
    failures = {
        rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        for rank, code in ((0, by), (1, stopped))
    }
    failures[0].error_file_data = {
        "dtrain": {"message": WAITED, "traceback": WAITED, "user_error": False}
    }
    return format_failures(failures, stacks={1: STOPPED_HERE})


def _checkpoint(root: Path, files: tuple[str, ...] = ("model.safetensors", "trainer.pt")) -> Path:
    """A one-tensor consolidated checkpoint under `root`, its manifest listing `files`."""
    path = step_path(root, 3)
    path.mkdir(parents=True)
    safetensors.torch.save_file({"w": torch.zeros(4)}, path / "model.safetensors")
    torch.save({"step": 3}, path / "trainer.pt")
    info = {"step": 3, "epoch": 0, "world_size": 1, "strategy": "single"}
    write_manifest(path, FORMAT, info, {"w": ([4], torch.float32)}, file_records(path, files))
    return path


def _truncated(tmp: Path) -> str:
    path = _checkpoint(tmp)
    (path / "model.safetensors").write_bytes(b"\0" * 8)
    return run_ckpt("verify", str(path)).stderr


def _skipped(tmp: Path) -> str:
    path = _checkpoint(tmp)
    (path / "trainer.pt").unlink()
    engine = dtrain.init(strategy="single", seed=0)
    engine.setup(nn.Linear(4, 1))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine.resume(tmp)
    engine.close()
    return out.getvalue()


def _changed_after_init(tmp: Path) -> str:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 4)
            self.init_weights()

        def init_weights(self) -> None:
            nn.init.zeros_(self.lm_head.weight)

    engine = dtrain.init(strategy="single", seed=0)
    with engine.init_empty():
        model = Head()
        model.lm_head = nn.Linear(4, 8)
    try:
        engine.setup(model)
    finally:
        engine.close()
    raise AssertionError("setup took the changed model.")


def _disk(tmp: Path, code: int) -> str:
    error = OSError(code, os.strerror(code))
    return str(write_failed(step_path(tmp, 3), error, 10**6))


class _Planned(nn.Module):
    """A layer of 5 output features, and a plan that splits it and names `path`."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.path = path

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        return {self.path: "colwise"}


def _taken_over(tmp: Path) -> str:
    gone = {"host": socket.gethostname(), "pid": 2**22 + 1, "started": "then", "ticks": None}
    (tmp / "dtrain.lock").write_text(json.dumps(gone))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out_lock.take(tmp).release()
    return err.getvalue()


def _in_use(tmp: Path) -> str:
    with out_lock.take(tmp):
        out_lock.take(tmp)
    raise AssertionError("The lock was taken twice.")


Trigger = Callable[[Path], str]

TRIGGERED: dict[str, Trigger] = {
    "--lr must be a finite number >= 0": lambda _: _refusal("demo", "--lr", "nan"),
    "dtrain demo has no flag --stratgy (did you mean --strategy?)": lambda _: _refusal(
        "demo", "--stratgy", "ddp"
    ),
    "dtrain run has no flag --x (did you mean ...?)": lambda _: _refusal(
        "run", "--stratgy", "ddp", "x.py"
    ),
    "dtrain demo does not take ...": lambda _: _refusal("demo", "ddp"),
    "--out X is a file": lambda tmp: _refusal("run", "--out", str(_file(tmp)), "x.py"),
    "--out X cannot be created: Y is a file": lambda tmp: _refusal(
        "run", "--out", str(_file(tmp) / "run"), "x.py"
    ),
    "--metrics-json X is a directory": lambda tmp: _refusal(
        "run", "--metrics-json", str(tmp), "x.py"
    ),
    "--out names no path": lambda _: _refusal("run", "--out", "", "x.py"),
    "Unknown --precision 'x'": lambda _: _refusal("run", "--precision", "x", "x.py"),
    "Unknown --activation-checkpointing": lambda _: _refusal(
        "run", "--activation-checkpointing", "x", "x.py"
    ),
    "Unknown --checkpoint-format": lambda _: _refusal("run", "--checkpoint-format", "x", "x.py"),
    "Unknown --schedule": lambda _: _refusal(
        "run", "--strategy", "pipeline", "--nproc", "2", "--schedule", "x", "x.py"
    ),
    "Unknown --dp-mode": lambda _: _refusal(
        "run", "--strategy", "hybrid", "--dp-mode", "x", "x.py"
    ),
    "--nproc must be at least 1": lambda _: _refusal("run", "--nproc", "0", "x.py"),
    "--virtual-stages must be at least 2": lambda _: _refusal(
        "run",
        "--strategy",
        "pipeline",
        "--nproc",
        "2",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "1",
        "x.py",
    ),
    "--strategy hybrid lays out dpD x ppP x tpT = N processes, but --nproc is M": lambda _: (
        _refusal(
            "run",
            "--strategy",
            "hybrid",
            "--nproc",
            "4",
            "--dp",
            "2",
            "--pp",
            "2",
            "--tp",
            "2",
            "x.py",
        )
    ),
    "--strategy pipeline splits the model along --pp only": lambda _: _refusal(
        "run", "--strategy", "pipeline", "--nproc", "2", "--tp", "2", "x.py"
    ),
    "--precision fp16-mixed is not supported under --strategy ps": lambda _: _refusal(
        "run", "--strategy", "ps", "--precision", "fp16-mixed", "x.py"
    ),
    "Unknown key 'x' in FILE, line L: dtrain demo has no flag --x": lambda tmp: _from_file(
        tmp, "lrr = 1\n"
    ),
    "'x' in FILE, line L must be an integer, but it is a string": lambda tmp: _from_file(
        tmp, 'nproc = "2"\n'
    ),
    "... must be true or false": lambda tmp: _from_file(tmp, "cpu = 1\n"),
    "'x' in FILE, line L is a table, but a config file holds flat keys only": lambda tmp: (
        _from_file(tmp, "[ddp]\nnproc = 2\n")
    ),
    "The loss is nan at step S": lambda _: str(NonFiniteLossError(3, float("nan"))),
    "Server S waiting for workers did not complete within 600s": lambda _: _ps_wait(
        "Server 0 waiting for workers", None, TIMED_OUT
    ),
    "Worker W sending to server S failed: the connection ended (...) because server S "
    "(rank R, at ADDRESS) stopped": lambda _: _ps_wait("Worker 0 sending to server 0", 2, CLOSED),
    "Worker W pulling parameters from server S did not complete within 600s (Timed out "
    "waiting ...): server S (rank R) hung or stopped": lambda _: _ps_wait(
        "Worker 0 pulling parameters from server 0", 2, TIMED_OUT
    ),
    "Rank R hung: rank Q waited longer than --timeout for it, and it was still running when "
    "the launcher stopped it, here (most recent call first)": lambda _: _failures(
        -signal.SIGTERM, 1
    ),
    "Rank R (...) was killed by signal SIGKILL: It raised no Python exception ... then start "
    "the job again: the checkpoints already written are intact": lambda _: _failures(
        -signal.SIGTERM, -signal.SIGKILL
    ),
    "The checkpoint does not fit this model (missing: ...; unexpected: ...; wrongly shaped: "
    "...)": lambda _: check_fit(
        {"a": torch.Size([2]), "b": torch.Size([2])},
        {"b": torch.zeros(3), "c": torch.zeros(1)},
    ),
    "... is damaged: model.safetensors is truncated": _truncated,
    ".../manifest.json is damaged: it cannot be read as JSON": lambda tmp: read_manifest(
        _written(tmp / MANIFEST, "{")
    ),
    'its "step" is "2", not an integer': lambda tmp: manifest_problem(
        json.loads((_checkpoint(tmp) / MANIFEST).read_text()) | {"step": "2"}
    ),
    "it holds [], not a JSON object": lambda _: manifest_problem([]),
    "... is damaged (manifest.json lists no model.safetensors)": lambda tmp: (
        run_ckpt("convert", str(_checkpoint(tmp, ("trainer.pt",))), str(tmp / "model.pt")).stderr
    ),
    "dtrain: warning: skipping damaged checkpoint DIR: ...": _skipped,
    "The checkpoint DIR could not be written: No space left on device (ENOSPC) in FOLDER, "
    "whose filesystem has X free, and this process had about Y of it to write": lambda tmp: _disk(
        tmp, errno.ENOSPC
    ),
    "The checkpoint DIR could not be written: Read-only file system (EROFS)": lambda tmp: _disk(
        tmp, errno.EROFS
    ),
    "Permission denied (EACCES)": lambda tmp: _disk(tmp, errno.EACCES),
    "--tp T does not fit GPT: tensor parallelism over T ranks splits the H attention heads": (
        lambda _: plan_of(build("gpt", "tiny"), 3)
    ),
    "X has N output features, which --tp T cannot split evenly": lambda _: plan_of(
        _Planned("fc"), 2
    ),
    "X's tensor-parallel plan names 'y', which matches no module": lambda _: plan_of(
        _Planned("head"), 2
    ),
    "Module 'x' (X) was changed after its init_weights() ran inside engine.init_empty "
    "(lm_head replaced)": _changed_after_init,
    "DIR is in use by another dtrain run (pid P on host H, started T)": _in_use,
    "dtrain: taking over DIR/dtrain.lock, left by a run that is gone (pid P on host H, "
    "started T)": _taken_over,
}
"""Messages assembled at run time, each with what produces it in a fresh folder: a
refusal is returned as its text, whatever raises it."""


def _file(tmp: Path) -> Path:
    return _written(tmp / "afile", "")


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path.parent if path.name == MANIFEST else path


def _produce(trigger: Trigger, tmp: Path) -> str:
    try:
        return str(trigger(tmp))
    except DtrainError as e:
        return str(e)


def test_every_message_the_troubleshooting_tables_quote_is_one_dtrain_prints(
    tmp_path: Path,
) -> None:
    wrong = []
    for number, message in quoted_messages():
        if message in TRIGGERED:
            folder = tmp_path / f"line{number}-{len(wrong)}-{abs(hash(message))}"
            folder.mkdir()
            produced = _normal(_produce(TRIGGERED[message], folder))
            if not matches(message, produced):
                wrong.append(f"line {number}: `{message}`; the code prints: {produced[:300]}")
        elif not in_source(message):
            wrong.append(f"line {number}: `{message}` is in no message of src/dtrain")
    assert not wrong, "docs/troubleshooting.md quotes messages dtrain does not print:\n" + (
        "\n".join(wrong)
    )


def test_each_triggered_message_is_quoted_by_the_document() -> None:
    quoted = {message for _, message in quoted_messages()}
    assert sorted(set(TRIGGERED) - quoted) == []


def test_a_message_that_is_printed_nowhere_is_not_found() -> None:
    assert not in_source("--sync-batchnorm needs GPUs")
    assert in_source("--sync-batchnorm has no effect under strategy")
    assert in_source("... has no .metadata (the index of its pieces)")


def test_the_hang_section_quotes_the_report_the_launcher_prints(tmp_path: Path) -> None:
    hung = next(message for message in TRIGGERED if message.startswith("Rank R hung:"))
    section = DOC.read_text().split("## A job hangs", 1)[1].split("\n## ", 1)[0]
    assert f'"{hung}"' in _normal(section)
    assert matches(hung, _normal(_produce(TRIGGERED[hung], tmp_path)))
