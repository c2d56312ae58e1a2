"""What each process `horovodrun` starts runs first: it sets Horovod's per-process
variables (HOROVOD_RANK, HOROVOD_LOCAL_RANK, ...) from the launcher's (RANK, LOCAL_RANK,
...), so the script sees them before `hvd.init()`, then runs the script or module.

    python -m dtrain.horovod.worker script PATH [ARGS...]
    python -m dtrain.horovod.worker module NAME [ARGS...]
"""

from __future__ import annotations

import os
import sys

from dtrain.horovod.basics import placement, set_environment
from dtrain.launch.bootstrap import run_target


def main(argv: list[str]) -> None:
    """Export this process's Horovod variables, then run the target in `argv`."""
    kind, target, *args = argv
    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    set_environment(rank, size, *placement(rank, size))
    run_target(kind, target, args)


if __name__ == "__main__":
    main(sys.argv[1:])
