"""The first code each worker runs: executes the user's script or module (or, on a rank
its strategy gives another role, such as a parameter server, that role's own main) and,
if it raises, records the traceback (rank-tagged, user frames only) where the agent
reads it. The file is written in one rename, and the launcher reads a damaged one as no
report: a rank stopped while it writes must not take the launcher down with it.

    python -m dtrain.launcher.bootstrap script PATH [ARGS...]
    python -m dtrain.launcher.bootstrap module NAME [ARGS...]
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.elastic.multiprocessing.api as elastic_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtrain.checkpoint.atomic import write_file
from dtrain.config import Config
from dtrain.errors import DtrainError
from dtrain.launcher.lifeline import die_with_launcher
from dtrain.launcher.stacks import dump_on_stop, mark_finished
from dtrain.process.teardown import exit_now
from dtrain.strategies.specs import lookup

_HIDDEN = (runpy.__file__, "<frozen runpy>", __file__)


def run_target(kind: str, target: str, args: list[str]) -> None:
    """Run a script file or a module as ``__main__`` with `args` as its argv."""
    if kind == "script":
        sys.argv = [target, *args]
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def role_main() -> Callable[[], None] | None:
    """What this rank runs instead of the target, where its strategy gives it a role of
    its own (a parameter server); None: it runs the target."""
    config = Config.from_env()
    if config is None or "RANK" not in os.environ:
        return None
    return lookup(config.strategy).role_main(config, int(os.environ["RANK"]))


def describe(error: BaseException) -> tuple[str, str]:
    """(one-line message, traceback without the launcher's own frames) of `error`."""
    if isinstance(error, DtrainError):
        return str(error), ""
    summary = traceback.extract_tb(error.__traceback__)
    frames = [f for f in summary if f.filename not in _HIDDEN]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    lines += traceback.format_exception_only(type(error), error)
    message = "".join(traceback.format_exception_only(type(error), error)).strip()
    return message, "".join(lines)


def record(error: BaseException) -> None:
    """Write `error` to TORCHELASTIC_ERROR_FILE in the format the elastic agent reads,
    atomically: the agent stops the other ranks when one fails, maybe while they write."""
    message, stack = describe(error)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
        },
        "dtrain": {
            "message": message,
            "traceback": stack,
            "user_error": isinstance(error, DtrainError),
        },
    }
    write_file(Path(path), json.dumps(data))


@dataclass
class _Failure(ProcessFailure):
    """The agent's record of a failed rank, with a damaged error file read as no report
    (torch raises, ending the launcher with restarts left): one left by a writer other
    than `record`, such as torch's own ``@record`` in the user's script, stopped midway."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except Exception:  # noqa: BLE001 - whatever is wrong with the file, it is no report
            self.error_file = ""  # no such file: torch's own "no report" path
            super().__post_init__()


@contextlib.contextmanager
def damaged_reports_ignored() -> Iterator[None]:
    """While the agent runs in this process, it reads the workers' error files with
    `_Failure` (torch's agent builds its failure records in this module)."""
    saved = elastic_processes.ProcessFailure
    elastic_processes.ProcessFailure = _Failure  # type: ignore[misc]
    try:
        yield
    finally:
        elastic_processes.ProcessFailure = saved  # type: ignore[misc]


def main(argv: list[str]) -> int:
    """Run the target (or this rank's role); return its exit code: the script's own
    `sys.exit` code, or 1 after recording an exception."""
    kind, target, *args = argv
    die_with_launcher()
    dump_on_stop()
    try:
        role = role_main()
        if role is not None:
            role()
        else:
            run_target(kind, target, args)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            if not e.code:
                mark_finished()
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"), as Python reports it
        return 1
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the agent
        record(e)
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            message, stack = describe(e)
            print(stack or message, file=sys.stderr)
        return 1
    mark_finished()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
