"""Reading the contents of checkpoint files, whatever state they are in.

`verify` checks every file against the size and checksum its manifest records before
anything is read; a file damaged behind a manifest that vouches for it (a copy tool that
rewrote the manifest over a damaged copy, a manifest recomputed after the damage) passes.
Reading it then fails inside safetensors, torch's unpickler or
torch.distributed.checkpoint; :func:`reading` turns every such failure into one
DamagedCheckpointError naming the file, so `resume` passes over the checkpoint to the one
before. The reasons quoted keep torch's diagnosis and drop its advice: dtrain never loads
with ``weights_only=False``, and never asks a user to.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

from dtrain import advice
from dtrain.errors import DamagedCheckpointError, DtrainError

_WEIGHTS_ONLY = "Weights only load failed"
"""How torch's weights-only unpickling error begins: its advice, then its diagnosis on the
last line before a pointer to the documentation."""
_DOCUMENTATION = "Check the documentation"
_NOT_A_ZIP = "_use_new_zipfile_serialization"
"""Part of torch's error for a file that mmap cannot map: no torch.save zip archive."""
_NEXT_SENTENCE = re.compile(r"(?<=\.) (?=[A-Z`])")
"""Where a second sentence begins (torch's errors go on with advice)."""
_REFUSED = re.compile(r"GLOBAL |allowlisted")
"""What torch's weights-only unpickler says when it refuses to build an object."""


def reason(error: BaseException) -> str:
    """What went wrong in `error`, in a few words of one line, without torch's advice."""
    text = str(error)
    if _NOT_A_ZIP in text:
        return "it is no torch.save archive"
    lines = [line.strip() for line in text.split(_DOCUMENTATION)[0].splitlines()]
    lines = [line for line in lines if line]
    if text.startswith(_WEIGHTS_ONLY) and lines:
        return _first_sentence(lines[-1].removeprefix("WeightsUnpickler error:").strip())
    line = _first_sentence(lines[0]) if lines else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _first_sentence(line: str) -> str:
    return _NEXT_SENTENCE.split(line, maxsplit=1)[0]


def refuses_objects(error: BaseException) -> bool:
    """Whether `error`, from a weights-only unpickler, refused an object it was asked to
    build (a payload, a script's own class) rather than met bytes that are no pickle."""
    return isinstance(error, pickle.UnpicklingError) and bool(_REFUSED.search(str(error)))


def damaged(what: str | Path, why: str) -> DamagedCheckpointError:
    """The error for the checkpoint file (or entry) `what`, whose contents cannot be read
    for the reason `why`."""
    return DamagedCheckpointError(
        f"{what} cannot be read ({why}), though it matches its checkpoint's manifest: it was "
        "damaged before the manifest was last written (by a copy or sync tool that rewrites "
        f"manifests, say). Use an older checkpoint ({advice.newest_intact()}), or restore "
        "this one from an intact copy."
    )


@contextlib.contextmanager
def reading(what: str | Path) -> Iterator[None]:
    """Read the checkpoint file (or entry) `what` in the block: any error but dtrain's own
    becomes :func:`damaged`'s DamagedCheckpointError."""
    try:
        yield
    except DtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the reader meets, the file is damaged
        raise damaged(what, reason(e)) from None
