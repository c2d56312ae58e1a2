"""`dtrain ckpt verify` and `inspect`: check a checkpoint against its manifest, summarise it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtrain.checkpoint.atomic import sha256_file
from dtrain.checkpoint.format import is_sharded, read_manifest


def verify(path: Path) -> list[str]:
    """Problems found in the checkpoint at `path` (empty when every file is intact)."""
    manifest = read_manifest(path)
    problems = []
    for name, expected in manifest.get("files", {}).items():
        file = Path(path) / name
        if not file.is_file():
            problems.append(f"{name} is missing")
            continue
        size = file.stat().st_size
        if size != expected["bytes"]:
            problems.append(
                f"{name} is truncated or altered: {size} bytes, "
                f"the manifest says {expected['bytes']}"
            )
        elif sha256_file(file) != expected["sha256"]:
            problems.append(f"{name} is corrupt: its SHA-256 differs from the manifest's")
    return problems


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
