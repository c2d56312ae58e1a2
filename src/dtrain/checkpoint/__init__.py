"""Portable checkpoints: directories that load under every strategy and world size,
consolidated (one safetensors file of the whole model) or sharded (one part per rank).

Measurement and files: it imports the leaves, `dtrain.config`, `dtrain.process` and
`dtrain.observe`, never a strategy (what it asks of one is its `holder.StateHolder`
protocol), the launcher or the Engine.
"""

from dtrain.checkpoint.directory import find_latest, latest_intact, prune, step_path
from dtrain.checkpoint.format import (
    FORMAT,
    SHARDED_FORMAT,
    is_sharded,
    load_model,
    read_manifest,
    read_model,
    read_pt,
    write,
)
from dtrain.process import torch_version  # noqa: F401 - refuses too old a torch before it is used

__all__ = [
    "FORMAT",
    "SHARDED_FORMAT",
    "find_latest",
    "is_sharded",
    "latest_intact",
    "load_model",
    "prune",
    "read_manifest",
    "read_model",
    "read_pt",
    "step_path",
    "write",
]
