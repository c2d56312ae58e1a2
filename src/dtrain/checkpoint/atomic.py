"""Atomic checkpoint directories (and files): written beside the target, then renamed
into place.

A reader sees either the previous checkpoint or the complete new one, never a half.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def temporary_beside(target: Path) -> Path:
    """A new, empty hidden directory next to `target` (same filesystem, so the final
    rename is atomic); directory scans skip it until :func:`commit` renames it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def commit(tmp: Path, target: Path) -> None:
    """Make the complete directory `tmp` appear as `target` in one rename (replacing a
    previous `target`), with every file flushed to disk first."""
    _share_as_umask_says(tmp)
    for path in tmp.iterdir():
        _fsync(path)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `target` in one rename.

    If the block raises, the temporary directory is removed and `target` is untouched.
    """
    target = Path(target)
    tmp = temporary_beside(target)
    try:
        yield tmp
        commit(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_file(target: Path, text: str) -> None:
    """Write `text` to the file `target` in one rename: a process killed meanwhile leaves
    the previous `target` (or none), never part of the new one."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-\w+")
"""A hidden directory of an interrupted write: `temporary_beside`'s or `commit`'s."""


def clean_leftovers(directory: Path) -> None:
    """Remove what interrupted writes left in `directory`: the temporary directory of a
    checkpoint never completed is deleted; a checkpoint set aside to be replaced
    (``.NAME.old-PID``) goes back into place if its replacement never arrived, else it
    is deleted. Call it only while nothing is being written into `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for child in directory.iterdir():
        found = _LEFTOVER.fullmatch(child.name)
        if found is None or not child.is_dir():
            continue
        target = directory / found["name"]
        if found["kind"] == "old" and not target.exists():
            os.replace(child, target)
        else:
            shutil.rmtree(child, ignore_errors=True)


def _share_as_umask_says(directory: Path) -> None:
    """Give `directory` and its files the modes the process's umask asks for: the
    temporary directory (0700) and files some writers create through temporary files
    (0600) would otherwise keep teammates on a shared disk out."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at `path`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_records(directory: Path, names: list[str]) -> dict[str, dict[str, object]]:
    """Size and SHA-256 of each named file of `directory` (the manifest's ``files``)."""
    return {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in names
    }
