"""What worker 0 tells the servers at start, and the collectives that start a ps job.

Servers never see the user's script: everything they need (the parameters' sizes,
groups and dtype, the optimizer's class and per-group settings, the initial values)
comes from worker 0 in :func:`handshake`, which every rank of the job (workers and
servers) calls once, so its collectives run in the same order everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dtrain.errors import ConfigError
from dtrain.parallel.broadcast import broadcast_bytes
from dtrain.strategies.ps import sharding
from dtrain.strategies.ps.protocol import Channel
from dtrain.strategies.ps.roles import Roles
from dtrain.strategies.rebuild import hyperparameters


@dataclass(frozen=True)
class Description:
    """The served parameters and the optimizer, as worker 0 has them.

    Attributes:
        sizes: numel of each parameter, in optimizer order (groups flattened).
        groups: the param-group index of each parameter.
        dtype: the parameters' dtype (one for all).
        optimizer: the optimizer's class name (a torch.optim class).
        settings: each param group's hyperparameters (without its parameters).
        defaults: the optimizer's defaults.
    """

    sizes: list[int]
    groups: list[int]
    dtype: torch.dtype
    optimizer: str
    settings: list[dict[str, Any]]
    defaults: dict[str, Any]

    @classmethod
    def of(cls, optimizer: Optimizer) -> Description:
        """The description of `optimizer` and the parameters it holds."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return cls(
            sizes=[p.numel() for p in params],
            groups=[i for i, g in enumerate(optimizer.param_groups) for _ in g["params"]],
            dtype=params[0].dtype,
            optimizer=type(optimizer).__name__,
            settings=[hyperparameters(group) for group in optimizer.param_groups],
            defaults=dict(optimizer.defaults),
        )

    @property
    def numel(self) -> int:
        """Elements of all the served parameters."""
        return sum(self.sizes)

    def plan(self, servers: int) -> sharding.Plan:
        """Where every bucket lives on `servers` servers (the same on every rank)."""
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return sharding.plan(self.sizes, self.groups, servers, element_size)

    def layout(self) -> tuple[list[int], list[int], torch.dtype, str]:
        """What must agree between workers for them to serve the same model."""
        return self.sizes, self.groups, self.dtype, self.optimizer


@dataclass(frozen=True)
class Start:
    """What every rank has after the handshake.

    Attributes:
        description: worker 0's description.
        values: the initial values of the served parameters (flat, workers' layout).
        workers: the process group of the workers.
        channel: the run's own group of every rank, for the ps messages.
    """

    description: Description
    values: torch.Tensor
    workers: dist.ProcessGroup
    channel: Channel


def handshake(mine: Description | None, values: torch.Tensor | None, roles: Roles) -> Start:
    """The start of a training run under ps: worker 0's description and initial parameter
    values reach every rank, then every rank takes part in creating the workers' group and
    the run's group of every rank.

    Args:
        mine: this worker's description (None on a server).
        values: this worker's parameters as one flat CPU tensor, overwritten with worker
            0's (None on a server, which gets a new tensor).
        roles: which ranks are the workers.

    Raises:
        ConfigError: this worker's parameters or optimizer differ from worker 0's.
    """
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    description: Description = box[0]  # type: ignore[assignment]
    if mine is not None and mine.layout() != description.layout():
        raise ConfigError(
            f"Worker {roles.index(dist.get_rank())}'s model or optimizer differs from worker "
            "0's (parameter sizes, param groups, dtype or optimizer class); every worker must "
            "build the same model and optimizer before engine.setup."
        )
    if values is None:
        values = torch.empty(description.numel, dtype=description.dtype)
    broadcast_bytes(values, 0, None)
    workers_group = dist.new_group(roles.worker_ranks)
    everyone = dist.new_group(list(range(dist.get_world_size())))
    return Start(description, values, workers_group, Channel(everyone, roles, dist.get_rank()))
