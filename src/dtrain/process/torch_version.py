"""Refuse a PyTorch older than the oldest the test suite passed on, when first imported.

dtrain composes recent torch.distributed pieces (FSDP2 `fully_shard`, DTensor tensor
parallel, `torch.distributed.pipelining`, DeviceMesh); on an older torch they fail deep
inside torch with messages that do not say why. This says why, once, before anything runs:
process/topology.py (which every strategy, the Engine, `dtrain.init` and both launchers import)
and the checkpoint package import it. `import dtrain` alone imports no torch, so that
`dtrain --help` answers at once.

``DTRAIN_ALLOW_OLD_TORCH=1`` turns the refusal into a warning: for a machine whose torch
cannot be changed (a lent GPU machine with its own image), where a check should still run
and say what breaks.
"""

from __future__ import annotations

import os
import re
import warnings

import torch

OLDEST = (2, 13)
"""The oldest torch release (major, minor) the test suite has passed on."""


def check_torch(version: str) -> None:
    """Raise ImportError naming the fix if `version` (e.g. "2.13.0+cpu") is too old."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= OLDEST:
        return
    message = (
        f"dtrain needs PyTorch {OLDEST[0]}.{OLDEST[1]} or newer, but torch {version} is "
        f"installed; upgrade it (pip install 'torch>={OLDEST[0]}.{OLDEST[1]}')."
    )
    if os.environ.get("DTRAIN_ALLOW_OLD_TORCH") == "1":
        warnings.warn(message + " Going on: DTRAIN_ALLOW_OLD_TORCH=1.", stacklevel=2)
        return
    raise ImportError(message)


check_torch(torch.__version__)
