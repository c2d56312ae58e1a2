"""`dtrain.init()`: Config + Topology + Strategy -> Engine, seeds settled, group joined."""

from __future__ import annotations

import os
from typing import Any

import torch

from dtrain.config import Config
from dtrain.engine.engine import Engine
from dtrain.errors import ConfigError
from dtrain.process.rng import initial_seeds, settle_seed
from dtrain.process.topology import init_process_group
from dtrain.strategies.specs import StrategySpec, lookup


def init(strategy: str | None = None, **options: Any) -> Engine:
    """Create the Engine of this process.

    Under `dtrain run` the topology comes from the launcher; arguments given here override
    it (for example ``dtrain.init(strategy="towers", towers=4)`` in a plain
    ``python script.py``). Options are the fields of :class:`dtrain.Config`.

    Picks the device and backend (``cuda:LOCAL_RANK`` and NCCL when GPUs are visible, the
    CPU and gloo otherwise), joins the process group when the strategy needs one, and
    settles the seed. With ``seed=S`` (``--seed S``) it seeds every RNG (Python, NumPy,
    torch on the CPU and on every GPU) with S on every rank, and ``engine.dataloader``
    shuffles with S. Without a seed it leaves the RNGs alone when every rank's
    ``torch.initial_seed()`` is the same (the script seeded every rank alike, or there is
    one process), and otherwise seeds every rank with rank 0's (noted in the log), so the
    replicas start equal; ``engine.dataloader`` then draws its shuffle seed from torch's
    generator when it is called, as ``DataLoader(shuffle=True)`` does (rank 0's draw, alike
    on every rank), so a script that calls ``torch.manual_seed`` before making its loader,
    before or after this call, shuffles alike in every run. ``engine.seed`` is S, or None.
    """
    config = Config.from_env() or _outside_dtrain_run()
    if strategy is not None:
        options["strategy"] = strategy
    config = config.replace(**options)
    spec = lookup(config.strategy)
    spec.check_options(config)
    topology = spec.detect_topology(config)
    if topology.world_size > 1 and not spec.multiprocess:
        raise ConfigError(
            f"Strategy '{spec.name}' runs in one process, but this job has "
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
            f"{torch.cuda.get_device_name()} has none. Use --precision fp16-mixed (fp16 "
            "compute with loss scaling) or fp32."
        )
    if spec.multiprocess:
        init_process_group(topology, config.timeout_s)
    settle_seed(config.seed, _training_seeds(spec, config), topology.is_main)
    return Engine(config, topology, spec.build(config, topology))


def _training_seeds(spec: StrategySpec, config: Config) -> list[int]:
    """`torch.initial_seed()` of every rank that runs the script, in rank order.

    Every process of a multi-process job takes part in the gather, even with a seed given:
    parameter servers, which never see the script's `dtrain.init` arguments, always join
    it; their own seeds are left out of the comparison.
    """
    seeds = initial_seeds(everyone=spec.multiprocess)
    return [s for rank, s in enumerate(seeds) if spec.role_main(config, rank) is None]


def _outside_dtrain_run() -> Config:
    """The Config of a process not started by `dtrain run` (plain python, torchrun): the
    strategy from DTRAIN_STRATEGY, else ddp when the launcher started several processes."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    chosen = os.environ.get("DTRAIN_STRATEGY") or ("ddp" if world > 1 else "single")
    return Config(strategy=chosen)
