"""dtrain: write the training loop once, run it on one device or many by changing one flag.

import dtrain
engine = dtrain.init()                       # topology from `dtrain run`, or arguments
model, optimizer = engine.setup(model, optimizer)
loader = engine.dataloader(dataset, batch_size=32)
for epoch in range(epochs):
    for batch in engine.progress(loader, epoch=epoch):
        loss = engine.train_step(batch, loss_fn)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtrain.config import Config
from dtrain.errors import (
    CheckpointError,
    ConfigError,
    DtrainError,
    LaunchError,
    NonFiniteLossError,
    SetupError,
)

if TYPE_CHECKING:
    from dtrain.data.shard_files import ShardFiles
    from dtrain.data.shard_write import write_shards
    from dtrain.engine import Engine
    from dtrain.engine.start import init
    from dtrain.launcher.notebook import launch
    from dtrain.observe.events import End, Observer, Run
    from dtrain.strategies.specs import available as available_strategies

__version__ = "0.1.0"

_LAZY = {
    "End": ("dtrain.observe.events", "End"),
    "Engine": ("dtrain.engine", "Engine"),
    "Observer": ("dtrain.observe.events", "Observer"),
    "Run": ("dtrain.observe.events", "Run"),
    "ShardFiles": ("dtrain.data.shard_files", "ShardFiles"),
    "available_strategies": ("dtrain.strategies.specs", "available"),
    "init": ("dtrain.engine.start", "init"),
    "launch": ("dtrain.launcher.notebook", "launch"),
    "write_shards": ("dtrain.data.shard_write", "write_shards"),
}
"""The public names that import torch, loaded on first use: `dtrain --help` and the
command line's errors import this package and must answer without torch."""


def __getattr__(name: str) -> Any:
    """Load a torch-dependent public name (PEP 562) the first time it is asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DtrainError",
    "End",
    "Engine",
    "LaunchError",
    "NonFiniteLossError",
    "Observer",
    "Run",
    "SetupError",
    "ShardFiles",
    "available_strategies",
    "init",
    "launch",
    "write_shards",
]
