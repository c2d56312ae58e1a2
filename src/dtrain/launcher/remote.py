"""One host's side of a job started over ssh (`dtrain.launcher.ssh`).

The head sends one JSON line on stdin: this node's Config (node rank, rendezvous),
the target and the head's environment. Then stdin stays open as a lifeline: when it
closes (the head hung up, died, or lost the connection) this launcher stops its agent
and workers with SIGTERM, so no process outlives the job on any host.

    python -m dtrain.launcher.remote < payload
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from dtrain.config import ENV_VAR, Config
from dtrain.errors import DtrainError, exit_report
from dtrain.launcher.quiet import import_quietly
from dtrain.process.teardown import exit_now

RANK_PREFIX_VAR = "DTRAIN_RANK_PREFIX"
"""Set on hosts started over ssh: the agent prefixes each worker's lines with its rank."""


def _hang_up_on_eof() -> None:
    """Wait for stdin to close, then stop this launcher as Ctrl-C would."""
    sys.stdin.read()
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    """Read the payload, run this node's share of the job; return the exit code."""
    runner = import_quietly("dtrain.launcher.runner")
    Target, launch = runner.Target, runner.launch
    payload = json.loads(sys.stdin.readline())
    os.environ.update(payload["env"])
    os.environ.pop(ENV_VAR, None)
    os.environ[RANK_PREFIX_VAR] = "1"
    config = Config.from_json(payload["config"])
    target = payload["target"]
    threading.Thread(target=_hang_up_on_eof, daemon=True).start()
    try:
        launch(config, Target(target["kind"], target["name"], tuple(target["args"])))
    except (DtrainError, KeyboardInterrupt) as e:
        message, code = exit_report(e)
        print(f"dtrain: {message}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    exit_now(main())
