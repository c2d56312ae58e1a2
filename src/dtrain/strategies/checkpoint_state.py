"""What checkpoints ask of a strategy: its model and optimizer state, whole or per replica.

:class:`CheckpointState` is the part of a runtime strategy that the checkpoints call
(engine/checkpoints.py; the formats through their protocol,
`dtrain.checkpoint.holder.StateHolder`, which every Strategy fulfils). Its defaults hold
where `unwrap()` is the whole model on every rank and the loop steps a torch optimizer
over its parameters; strategies that shard the state, keep replicas apart between syncs
or hold it on servers override them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from dtrain.checkpoint.format import load_model, model_tensors
from dtrain.checkpoint.optimizer_state import load_by_name, state_by_name
from dtrain.parallel.compression import powersgd_of
from dtrain.process.collectives import rank_in
from dtrain.process.topology import Topology
from dtrain.strategies.placement import Placement


class _Holder(Protocol):
    """What the defaults read of the strategy they belong to."""

    topology: Topology
    placement: Placement
    model: nn.Module | None

    def unwrap(self) -> nn.Module: ...


class CheckpointState:
    """The state a checkpoint saves and loads; mixed into every runtime `Strategy`."""

    @property
    def state_by_module(self) -> bool:
        """True if the optimizer the loop steps is a torch optimizer over `unwrap()`'s
        parameters, so torch.distributed.checkpoint's state_dict helpers read this rank's
        part directly (sharded checkpoints); False sends sharded checkpoints through
        `full_state`."""
        return True

    @property
    def checkpoint_group(self: _Holder) -> dist.ProcessGroup | None:
        """The group whose ranks save and load a checkpoint together: the training ranks
        (read when a checkpoint is taken, after setup has joined them)."""
        return self.placement.train_group

    @property
    def model_class(self: _Holder) -> str:
        """The class name of the user's model (recorded in checkpoint manifests)."""
        return type(self.unwrap()).__name__

    def full_state(
        self: _Holder, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """The whole model (canonical names, CPU) and name-keyed optimizer state.

        Called on every rank (sharded strategies gather); returns the states on the main
        rank and (None, None) elsewhere.
        """
        if not self.topology.is_main:
            return None, None
        module = self.unwrap()
        return model_tensors(module), state_by_name(optimizer, module) if optimizer else None

    def load_full_state(
        self: _Holder,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        """Load whole tensors and name-keyed optimizer state (every rank passes them).

        Returns the names skipped with strict=False.
        """
        module = self.unwrap()
        skipped = load_model(module, tensors, strict)
        if optimizer is not None and optimizer_state is not None:
            loaded = {n for n, _ in module.named_parameters()} - set(skipped)
            load_by_name(optimizer, module, optimizer_state, loaded if skipped else None)
        return skipped

    def own_state(self: _Holder, optimizer: Optimizer | None) -> dict[str, Any] | None:
        """What this rank trains apart from the model and optimizer state `full_state`
        saves, for the trainer state of a checkpoint: ``{"replica": ..., "powersgd": ...}``
        (a replica between syncs, local-sgd's; PowerSGD's error feedback, kept by the DDP
        wrapper under --grad-compression powersgd); None, alike on every rank: nothing."""
        powersgd = powersgd_of(self.model)
        return None if powersgd is None else {"replica": None, "powersgd": powersgd.state_dict()}

    def load_own_state(
        self: _Holder,
        mine: dict[str, Any] | None,
        first: dict[str, Any] | None,
        optimizer: Optimizer | None,
        model_loaded: bool,
    ) -> list[str]:
        """After a checkpoint's model and optimizer state are loaded (`model_loaded`: the
        whole model), continue this rank's `own_state` from `mine` (None where the job that
        saved it had another number of ranks, or saved none); `first` is the first rank's.
        Returns what to tell the user, each a sentence that follows the checkpoint's path.

        PowerSGD state that does not fit this job (another world size or rank, or none
        saved) is left behind: PowerSGD starts afresh, two whole steps, then compression
        with no error feedback carried over (another job's errors belong to other ranks'
        gradients)."""
        powersgd = powersgd_of(self.model)
        if powersgd is None:
            return []
        state = mine.get("powersgd") if mine else None
        if powersgd.fits(state):
            powersgd.load_state_dict(state)
            return []
        _, ranks = rank_in(self.placement.train_group)
        return [
            f"holds no PowerSGD state of {ranks} processes at rank {powersgd.rank}; PowerSGD "
            "starts afresh (its error feedback restarts from zero)."
        ]
