"""Portable checkpoints: one directory format for every strategy and world size."""

from dtrain.checkpoint.format import (
    FORMAT,
    find_latest,
    load_model,
    read_manifest,
    read_model,
    read_pt,
    write,
)

__all__ = ["FORMAT", "find_latest", "load_model", "read_manifest", "read_model", "read_pt", "write"]
