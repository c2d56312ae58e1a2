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

import os
from typing import Any

import torch

from dtrain import requirements  # noqa: F401 - refuses too old a torch before it is used
from dtrain.config import Config
from dtrain.engine import Engine
from dtrain.errors import (
    CheckpointError,
    ConfigError,
    DtrainError,
    LaunchError,
    NonFiniteLossError,
    SetupError,
)
from dtrain.launch.notebook import launch
from dtrain.rng import seed_everything
from dtrain.strategies import available as available_strategies
from dtrain.strategies import lookup
from dtrain.topology import init_process_group

__version__ = "0.1.0"


def init(strategy: str | None = None, **options: Any) -> Engine:
    """Create the Engine of this process.

    Under `dtrain run` the topology comes from the launcher; arguments given here override
    it (for example ``dtrain.init(strategy="towers", towers=4)`` in a plain
    ``python script.py``). Options are the fields of :class:`dtrain.Config`.

    Seeds every RNG on every device (so replicas start equal), picks the device and backend
    (``cuda:LOCAL_RANK`` and NCCL when GPUs are visible, the CPU and gloo otherwise), and
    joins the process group when the strategy needs one.
    """
    config = Config.from_env() or _outside_dtrain_run()
    if strategy is not None:
        options["strategy"] = strategy
    config = config.replace(**options)
    strategy_cls = lookup(config.strategy)
    strategy_cls.check_options(config)
    topology = strategy_cls.detect_topology(config)
    if topology.world_size > 1 and not strategy_cls.multiprocess:
        raise ConfigError(
            f"Strategy '{strategy_cls.name}' runs in one process, but this job has "
            f"{topology.world_size} processes; launch it with --nproc 1, or choose a "
            "multi-process strategy such as ddp."
        )
    if (
        config.precision == "bf16-mixed"
        and topology.device.type == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigError(
            "--precision bf16-mixed needs a GPU with bfloat16 support; "
            f"{torch.cuda.get_device_name()} has none. Use --precision fp32."
        )
    seed_everything(config.seed)
    if strategy_cls.multiprocess:
        init_process_group(topology, config.timeout_s)
    return Engine(config, topology, strategy_cls(config, topology))


def _outside_dtrain_run() -> Config:
    """The Config of a process not started by `dtrain run` (plain python, torchrun): the
    strategy from DTRAIN_STRATEGY, else ddp when the launcher started several processes."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    chosen = os.environ.get("DTRAIN_STRATEGY") or ("ddp" if world > 1 else "single")
    return Config(strategy=chosen)


__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DtrainError",
    "Engine",
    "LaunchError",
    "NonFiniteLossError",
    "SetupError",
    "available_strategies",
    "init",
    "launch",
]
