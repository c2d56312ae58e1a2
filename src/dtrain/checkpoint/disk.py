"""Checkpoint writes that the disk refuses: full, over quota, read-only.

Every write of a checkpoint runs inside :func:`writing`. An OSError met there, however
the writer reports it (torch.save's "unexpected pos", safetensors' SafetensorError,
torch.distributed.checkpoint's CheckpointException), becomes one CheckpointError that
names the folder, the space left there, what was being written and what to do. The
writers remove their temporary directory on the way out, so the checkpoints before it
stay as they were and ``--resume`` lands on the newest of them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from dtrain import advice
from dtrain.errors import CheckpointError, DtrainError
from dtrain.observe.memory import local_bytes

OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT}
"""Errors that more room on the disk cures."""
NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}
"""Errors that a writable folder cures."""

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How Rust's std::io::Error (safetensors' writer) ends its message for an OS error."""


def save_pt(value: Any, file: Path) -> None:
    """`torch.save` of `value` to `file`, through a Python file object: a failed write then
    leaves its OSError in the error's context, where a path given to torch.save leaves
    only "unexpected pos" of torch's own writer."""
    with open(file, "wb") as f:
        torch.save(value, f)


def stored_bytes(*values: Any) -> int:
    """Bytes of the tensors in `values` (nested dicts, lists and tuples) that this process
    holds: about what writing them takes on disk."""
    return local_bytes(_tensors(values))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def os_error_of(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, its cause or context, a rank's failure inside a
    CheckpointException, the OS error a SafetensorError quotes), or None."""
    # Imported here: the launcher reads checkpoints' folders through this package and has
    # no use for torch.distributed.checkpoint (most of a second to import).
    from torch.distributed.checkpoint.api import CheckpointException

    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if isinstance(current, CheckpointException):
            pending += [failure for failure, _ in current.failures.values()]
        if isinstance(current, SafetensorError):
            code = _RUST_OS_ERROR.search(str(current))
            if code:
                return OSError(int(code[1]), os.strerror(int(code[1])))
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def write_failed(target: Path, error: OSError, size: int | None) -> CheckpointError:
    """The error for the checkpoint `target` that could not be written: `error` from the OS,
    after trying to write about `size` bytes (None if unknown)."""
    target = Path(target)
    folder = target.parent
    code = errno.errorcode.get(error.errno or 0)
    reason = f"{error.strerror or error}" + (f" ({code})" if code else "")
    needed = f", and this process had about {_amount(size)} of it to write" if size else ""
    if error.errno in OUT_OF_SPACE:
        fix = (
            "Free space there, point --out at a disk with room, or keep fewer checkpoints "
            "(--keep-checkpoints, or keep= of engine.save)."
        )
    elif error.errno in NOT_WRITABLE:
        fix = "Make the folder writable, or point --out at one that is."
    else:
        fix = "Check that disk, or point --out at another one."
    return CheckpointError(
        f"The checkpoint {target} could not be written: {reason} in {folder}, whose "
        f"filesystem has {_free(folder)} free{needed}. Nothing of it was kept, and the "
        f"checkpoints before it are intact ({advice.how_to_resume()}). {fix}"
    )


@contextlib.contextmanager
def writing(target: Path, size: int | None = None, partial: Path | None = None) -> Iterator[None]:
    """Turn an OSError of the block, which writes the checkpoint `target` (about `size`
    bytes), into :func:`write_failed`'s CheckpointError; other errors pass unchanged.
    If the block fails, the folder `partial` (its unfinished writing) is removed first,
    so the free space the error names is what the next attempt has."""
    try:
        yield
    except BaseException as e:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        found = None if isinstance(e, DtrainError) else os_error_of(e)
        if found is None:
            raise
        raise write_failed(target, found, size) from e


def _free(folder: Path) -> str:
    """The free space of the filesystem of `folder` (or of its nearest existing parent:
    a folder that could not be made)."""
    for place in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            return _amount(shutil.disk_usage(place).free)
    return "an unknown amount"


def _amount(size: int) -> str:
    """`size` bytes in words: "512 bytes", "12.0 KiB", "3.4 GiB"."""
    if size < 1024:
        return f"{size} bytes"
    amount, units = size / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while amount >= 1024 and len(units) > 1:
        amount /= 1024
        units.pop(0)
    return f"{amount:.1f} {units[0]}"
