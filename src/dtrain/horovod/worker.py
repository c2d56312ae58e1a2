"""What each process `horovodrun` starts runs first: it sets Horovod's per-process
variables (HOROVOD_RANK, HOROVOD_LOCAL_RANK, ...) from the launcher's (RANK, LOCAL_RANK,
...), so the script sees them before `hvd.init()`, copies its output to
``--output-filename``'s files if asked, then runs the script or module in this process, or
any other program as a child (`dtrain.horovod.command`).

    python -m dtrain.horovod.worker script PATH [ARGS...]
    python -m dtrain.horovod.worker module NAME [ARGS...]
    python -m dtrain.horovod.worker command PROGRAM [ARGS...]
"""

from __future__ import annotations

import os
import sys

from dtrain.horovod.basics import placement, set_environment
from dtrain.horovod.command import run_command
from dtrain.horovod.output import OUTPUT_VAR, tee_streams
from dtrain.launcher.bootstrap import run_target


def main(argv: list[str]) -> None:
    """Export this process's Horovod variables, then run the target in `argv`."""
    kind, target, *args = argv
    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    set_environment(rank, size, *placement(rank, size))
    output = os.environ.get(OUTPUT_VAR)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    restore = tee_streams(output, rank, size, fresh=first_attempt) if output else None
    try:
        if kind == "command":
            code = run_command(target, args)
            if code:
                raise SystemExit(code)
        else:
            run_target(kind, target, args)
    finally:
        if restore is not None:
            restore()


if __name__ == "__main__":
    main(sys.argv[1:])
