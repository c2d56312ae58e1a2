"""`zero1`: DDP plus PyTorch's ZeroRedundancyOptimizer (ZeRO stage 1, Rajbhandari et al.
SC'20): each rank keeps the optimizer state of 1/N of the parameters, updates that part
and broadcasts it; gradients are all-reduced by DDP as usual.

Model-state memory per rank (fp32 Adam, psi parameters): 4 psi parameters + 4 psi
gradients + 8 psi / N optimizer state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from dtrain.checkpoint.format import check_fit, expected_shapes
from dtrain.config import Config
from dtrain.errors import ConfigError, SetupError
from dtrain.process.topology import Topology
from dtrain.strategies.checkpoint_state import CheckpointState
from dtrain.strategies.mesh import MeshStrategy
from dtrain.strategies.rebuild import NOT_FRESH, constructor_kwargs, has_stepped, hyperparameters
from dtrain.strategies.specs import StrategySpec


class Zero1(MeshStrategy):
    """DDP's replicas, optimizer state sharded over the data-parallel ranks."""

    def __init__(self, config: Config, topology: Topology, spec: StrategySpec) -> None:
        super().__init__(config, topology, spec)
        # Each rank's optimizer holds the state of its shard of the parameters.
        self.placement = replace(self.placement, splits_model=True)

    @property
    def state_by_module(self) -> bool:
        """ZeroRedundancyOptimizer's state is not a torch optimizer's over `unwrap()`."""
        return False

    def wrap(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        if optimizer is None:
            raise SetupError("Strategy zero1 shards the optimizer; pass one to engine.setup.")
        if has_stepped(optimizer):
            raise ConfigError(NOT_FRESH)
        dtypes = sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]})
        if len(dtypes) > 1:
            raise ConfigError(
                "Strategy zero1 shards the optimizer with torch's ZeroRedundancyOptimizer, "
                f"which needs its parameters in one dtype, but they are in {', '.join(dtypes)}; "
                "give the parameters one dtype (model.float(), or --precision bf16-mixed for "
                "16-bit compute), or use --strategy ddp."
            )
        wrapped, _ = super().wrap(model, None)
        # Imported where used: torch.distributed.optim scripts its functional optimizers
        # at import (a third of a second per process) that other strategies never need.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        first, *rest = optimizer.param_groups
        sharded = ZeroRedundancyOptimizer(
            first["params"],
            optimizer_class=type(optimizer),
            **constructor_kwargs(type(optimizer), first),
        )
        for group in rest:
            sharded.add_param_group(group)
        # Its groups are the user's own dicts (same parameters, same order), which it copies
        # into the local optimizer at every step: a scheduler built on the user's optimizer
        # before engine.setup drives the learning rate that trains.
        sharded.param_groups = optimizer.param_groups
        return wrapped, sharded

    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)  # collective: every rank sends its shard
        # Rank 0 alone holds the consolidated state: skip the mesh's every-rank gathering.
        return CheckpointState.full_state(self, optimizer)

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        """Every rank loads the whole model and hands the whole optimizer state to
        ZeroRedundancyOptimizer, which keeps the state of its own shard of the parameters
        (the mesh's DCP loader would first ask it for a consolidated state it lacks)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = optimizer.param_groups if optimizer is not None else []
        if isinstance(optimizer, ZeroRedundancyOptimizer) and optimizer_state is not None:
            # It loads the state of the parameters the checkpoint has state for and keeps
            # its own for the others (all of them, from Adam saved before its first step);
            # a checkpoint that does not fit is refused before anything changes.
            check_fit(expected_shapes(self.unwrap()), tensors, strict)
            optimizer.optim.state.clear()
        skipped = CheckpointState.load_full_state(self, tensors, optimizer, optimizer_state, strict)
        if isinstance(optimizer, ZeroRedundancyOptimizer) and optimizer.param_groups is not groups:
            # Loading put new group dicts in place of the user's; the user's take the
            # loaded settings and go back in, so a scheduler on the user's optimizer still
            # drives the learning rate that trains.
            for mine, loaded in zip(groups, optimizer.param_groups, strict=True):
                mine.update(hyperparameters(loaded))
            optimizer.param_groups = groups
            # Its exposed `state` now holds a second copy of this rank's shard; it steps
            # with the local optimizer's, so the copy only costs memory.
            optimizer.state.clear()
        return skipped
