"""A run's folder of checkpoints: ``ROOT/step-NNNNNNNN``, newest first, keep the last K."""

from __future__ import annotations

import shutil
from pathlib import Path

from dtrain.checkpoint.format import MANIFEST, read_manifest
from dtrain.checkpoint.verify import verify
from dtrain.errors import CheckpointError


def step_path(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives under `root`."""
    return Path(root) / f"step-{step:08d}"


def checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, newest (highest step) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith("."):
            continue  # a checkpoint being written, or being replaced
        try:
            if not (child / MANIFEST).is_file():
                continue
            step = int(read_manifest(child).get("step", -1))
        except CheckpointError:
            step = -1  # an unreadable manifest sorts last; verify reports it
        except OSError:
            continue  # deleted while this scan looked at it
        found.append((step, child))
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def find_latest(root: Path) -> Path | None:
    """The checkpoint under `root` with the highest step, or None if there is none."""
    found = checkpoints(root)
    return found[0] if found else None


def latest_intact(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that passes `verify`, and a warning for each
    newer one that did not (so a corrupt newest falls back to the one before)."""
    warnings = []
    for path in checkpoints(root):
        try:
            problems = verify(path)
        except CheckpointError as e:
            problems = [str(e)]
        if not problems:
            return path, warnings
        warnings.append(f"skipping damaged checkpoint {path}: {'; '.join(problems)}")
    return None, warnings


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `root` (one being
    written is not listed yet, so it never counts as kept). Call it on one rank only,
    once no other rank reads the older ones."""
    for old in checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
