"""Portable checkpoints: one directory format for every strategy and world size."""

from dtrain.checkpoint.directory import find_latest, latest_intact, prune, step_path
from dtrain.checkpoint.format import (
    FORMAT,
    load_model,
    read_manifest,
    read_model,
    read_pt,
    write,
)

__all__ = [
    "FORMAT",
    "find_latest",
    "latest_intact",
    "load_model",
    "prune",
    "read_manifest",
    "read_model",
    "read_pt",
    "step_path",
    "write",
]
