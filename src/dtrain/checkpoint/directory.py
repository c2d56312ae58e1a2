"""A run's folder of checkpoints: ``ROOT/step-NNNNNNNN``, newest first, keep the last K.

Keeping the last K deletes only checkpoints that a save with ``keep`` wrote, under the
name their manifest records (ROTATED_AS): a user's copy of one (``best``), a ``dtrain
ckpt convert`` output or any other folder beside them is never deleted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from dtrain.checkpoint.format import MANIFEST, read_manifest
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError

STEP_NAME = re.compile(r"step-(\d+)")
"""The name :func:`step_path` gives a checkpoint directory."""
ROTATED_AS = "rotated_as"
"""The manifest field a save with `keep` records: the name of the folder it wrote. Only a
checkpoint still under that name is one :func:`prune` may delete."""


def step_path(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives under `root`."""
    return Path(root) / f"step-{step:08d}"


def checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, newest (highest step) first.

    A damaged one is listed too, at the step its manifest or else its name
    (``step-NNNNNNNN``) gives, so that `latest_intact` warns about it rather than
    passing over it in silence; a directory with neither is no checkpoint.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith("."):
            continue  # a checkpoint being written, or being replaced
        named = STEP_NAME.fullmatch(child.name)
        try:
            if not child.is_dir() or not ((child / MANIFEST).is_file() or named):
                continue
            step = read_manifest(child)["step"]
        except CheckpointError:
            step = int(named.group(1)) if named else -1  # latest_intact reports it
        except OSError:
            continue  # deleted while this scan looked at it
        found.append((step, child))
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def find_latest(root: Path) -> Path | None:
    """The checkpoint under `root` with the highest step, or None if there is none."""
    found = checkpoints(root)
    return found[0] if found else None


def problems_of(path: Path) -> list[str]:
    """What `verify` finds wrong with the checkpoint at `path`, its manifest included
    (empty when it is intact)."""
    if not (Path(path) / MANIFEST).is_file():
        return [f"{MANIFEST} is missing"]
    try:
        return verify(path)
    except CheckpointError as e:
        return [str(e)]


def latest_intact(root: Path, below: Path | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that passes `verify`, and a warning for each
    newer one that did not (so a corrupt newest falls back to the one before). With
    `below` (one found unreadable), only the checkpoints older than it are looked at."""
    found = checkpoints(root)
    if below is not None and Path(below) in found:
        found = found[found.index(Path(below)) + 1 :]
    warnings = []
    for path in found:
        problems = problems_of(path)
        if not problems:
            return path, warnings
        warnings.append(f"skipping damaged checkpoint {path}: {'; '.join(problems)}")
    return None, warnings


def prune(root: Path, keep: int, written: Path | None = None) -> None:
    """Delete all but the newest `keep` checkpoints under `root` that saves with `keep`
    wrote (:func:`rotated`); one being written is not listed yet, so it never counts as
    kept. Call it on one rank only, once no other rank reads the older ones.

    `written`, the checkpoint just written, is kept and counted first: checkpoints of
    later steps (an earlier attempt's that `resume` skipped as damaged, to be written
    again when training reaches their step) are left alone, not counted as kept.
    """
    found = [path for path in checkpoints(root) if rotated(path)]
    if written is not None and Path(written) in found:
        found = found[found.index(Path(written)) :]
    for old in found[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def rotated(path: Path) -> bool:
    """Whether the checkpoint at `path` is one a save with `keep` wrote there: its
    manifest names the folder it is in. A copy or a rename of it, a converted checkpoint
    and one whose manifest cannot be read are not."""
    try:
        return read_manifest(path).get(ROTATED_AS) == Path(path).name
    except (CheckpointError, OSError):
        return False
