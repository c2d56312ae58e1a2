"""What an Engine answers without training: who this process is in the job, where
training stands, a main-rank print, and collectives over the job's processes (`JobView`,
the Engine's base class)."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.observe.memory import MemoryReport
from dtrain.process.collectives import barrier
from dtrain.process.logs import log_to_file
from dtrain.process.topology import Topology
from dtrain.step.position import Position
from dtrain.strategies.base import Strategy


class JobView:
    """This process's place in the job, read from the Engine's configuration, topology,
    strategy and position (which the Engine sets)."""

    config: Config
    topology: Topology
    strategy: Strategy
    position: Position
    memory_watch: MemoryReport

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load`)."""
        return self.position.step

    @property
    def epoch(self) -> int:
        """The epoch training is in: the training loader's pass, in any loop (restored
        by `load`)."""
        return self.position.epoch

    @property
    def seed(self) -> int | None:
        """The seed given to `dtrain.init` (``--seed S``, ``seed=S``), which seeded every
        generator on every rank and which `dataloader` shuffles with; None without one
        (`dataloader` then draws each shuffle's seed from torch's generator, as
        ``DataLoader(shuffle=True)`` does)."""
        return self.config.seed

    @property
    def restart_count(self) -> int:
        """How many times the launcher has restarted the group (0 on the first attempt)."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, which prints and writes checkpoints."""
        return self.topology.is_main

    @property
    def device(self) -> torch.device:
        """Where batches go before the model sees them."""
        return self.strategy.placement.input_device

    @property
    def dp_size(self) -> int:
        """Data-parallel processes: the global batch is the per-worker batch times this."""
        return self.strategy.placement.dp_size

    @property
    def memory(self) -> dict[str, int] | None:
        """Model-state bytes of this rank after its first step (with memory_report)."""
        return self.memory_watch.memory

    def memory_report(self) -> list[dict[str, int]]:
        """Every rank's model-state bytes, measured at the first step (needs
        ``memory_report=True``); collective the first time after that step, then kept (the
        figures do not change), so the metrics JSON at close reuses a script's own call."""
        return self.memory_watch.report()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main rank only."""
        if self.is_main:
            builtins.print(*args, **kwargs, flush=True)

    def log_to(self, directory: str | Path) -> Path:
        """Write this rank's log to ``directory/rank{R}.log``; return its path."""
        return log_to_file(Path(directory), self.rank)

    def barrier(self) -> None:
        """Wait for every process of the training loop (no-op in a one-process job)."""
        barrier(self.strategy.placement.train_group)

    def all_reduce_mean(self, value: float) -> float:
        """The mean of `value` over the data-parallel processes."""
        if not (self.strategy.spec.multiprocess and dist.is_initialized()):
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(t, group=self.strategy.placement.dp_group)
        return t.item() / dist.get_world_size(self.strategy.placement.dp_group)
