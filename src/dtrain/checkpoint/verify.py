"""`dtrain ckpt verify` and `inspect`: check a checkpoint against its manifest and read it
through, summarise it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtrain.checkpoint import safetensors_file
from dtrain.checkpoint.atomic import sha256_file
from dtrain.checkpoint.format import (
    INDEX,
    MANIFEST,
    MODEL_FILE,
    TRAINER_FILE,
    is_sharded,
    read_manifest,
    read_pt,
)
from dtrain.checkpoint.reading import reading
from dtrain.errors import DamagedCheckpointError


def verify(path: Path) -> list[str]:
    """Problems found in the checkpoint at `path` (empty when every file is intact); a
    CheckpointError naming the manifest if that is damaged."""
    manifest = read_manifest(path)
    files = manifest["files"]
    needed = (INDEX if is_sharded(manifest) else MODEL_FILE, TRAINER_FILE)
    problems = [f"{MANIFEST} lists no {name}" for name in needed if name not in files]
    for name, expected in files.items():
        problems += _file_problems(Path(path) / name, expected["bytes"], expected["sha256"])
    return problems


def read_through(path: Path) -> list[str]:
    """Problems met reading every file the manifest of the checkpoint at `path` lists (one
    damaged behind a manifest that vouches for it, `verify` cannot see); empty when each
    reads. Reads the whole checkpoint, so `dtrain ckpt verify` calls it, not a resume."""
    problems = []
    names = sorted(read_manifest(path)["files"])
    for name in names:
        file = Path(path) / name
        try:
            if name.endswith(".pt"):
                read_pt(Path(path), name)
            elif name.endswith(".safetensors"):
                with reading(file):
                    safetensors_file.load(file)
        except DamagedCheckpointError as e:
            problems.append(str(e))
    if INDEX in names:  # the pieces of a sharded checkpoint, read through its index
        # Imported here, not at the top: the launcher imports this package (through
        # `directory`), and torch.distributed.checkpoint would add about 0.6 s to its start.
        from dtrain.checkpoint.dcp_io import read_entries

        try:
            read_entries(Path(path), lambda _: True)
        except DamagedCheckpointError as e:
            problems.append(str(e))
    return problems


def _file_problems(file: Path, expected_bytes: int, expected_sha256: str) -> list[str]:
    """What differs between `file` and its manifest entry (empty when it matches)."""
    if not file.is_file():
        return [f"{file.name} is missing"]
    try:
        size = file.stat().st_size
        if size != expected_bytes:
            return [
                f"{file.name} is truncated or altered: {size} bytes, "
                f"the manifest says {expected_bytes}"
            ]
        if sha256_file(file) != expected_sha256:
            return [f"{file.name} is corrupt: its SHA-256 differs from the manifest's"]
    except OSError as e:
        return [f"{file.name} cannot be read ({e.strerror or e})"]
    return []


def summary(path: Path) -> list[tuple[str, Any]]:
    """(field, value) rows describing the checkpoint at `path`."""
    m = read_manifest(path)
    tensors = m.get("tensors", {})
    rows: list[tuple[str, Any]] = [
        ("path", str(path)),
        ("format", m["format"]),
        (
            "layout",
            "sharded: torch.distributed.checkpoint pieces, one set per rank"
            if is_sharded(m)
            else "consolidated: model.safetensors",
        ),
        ("strategy", m.get("strategy")),
        ("world_size", m.get("world_size")),
        ("step", m.get("step")),
        ("epoch", m.get("epoch")),
        ("model", m.get("model_class")),
        ("parameters", f"{m.get('num_parameters', 0):,}"),
        ("tensors", len(tensors)),
        ("optimizer", m.get("optimizer") or "none"),
        ("created", m.get("created")),
    ]
    rows += [(f"  {name}", f"{info['dtype']} {info['shape']}") for name, info in tensors.items()]
    rows += [
        (f"file {name}", f"{info['bytes']:,} bytes") for name, info in m.get("files", {}).items()
    ]
    return rows
