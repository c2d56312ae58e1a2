"""The launcher's own process imports torch with its C++ warnings off.

Between machines, torch's elastic agents meet at an exit barrier on node 0's store; when
node 0 leaves first, the others' last read of that store fails and torch's C++ layer
prints a warning with a native stack trace, although the job succeeded. The launcher has
nothing to say at that level that dtrain does not say better, so its process loads torch
with ``TORCH_CPP_LOG_LEVEL=ERROR``; the variable is restored at once, so the workers it
starts keep torch's usual warnings.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

LEVEL_VAR = "TORCH_CPP_LOG_LEVEL"


def import_quietly(module: str) -> ModuleType:
    """Import `module` (which imports torch) with torch's C++ warnings off in this process,
    unless torch is already loaded or the user chose a level."""
    if "torch" in sys.modules or LEVEL_VAR in os.environ:
        return importlib.import_module(module)
    os.environ[LEVEL_VAR] = "ERROR"
    try:
        return importlib.import_module(module)
    finally:
        del os.environ[LEVEL_VAR]
