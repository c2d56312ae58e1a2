"""Per-rank log files: ``DIR/rank{R}.log`` for the ``dtrain`` logger."""

from __future__ import annotations

import logging
from pathlib import Path

LOGGER = logging.getLogger("dtrain")
# Without a handler anywhere, logging would print each warning on every rank's stderr
# (its last resort), beside the line the main rank already prints: the records go to the
# rank's log file (`log_to_file`) and to the handlers a script configures, nowhere else.
LOGGER.addHandler(logging.NullHandler())


def log_to_file(directory: Path, rank: int) -> Path:
    """Send the ``dtrain`` logger of this rank to ``directory/rank{rank}.log``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.log"
    for handler in list(LOGGER.handlers):
        if (
            isinstance(handler, logging.FileHandler)
            and Path(handler.baseFilename) == path.resolve()
        ):
            return path
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    return path
