"""How `TorchState` saves, restores and synchronises each kind of object it holds:
models and optimizers by their state dicts (broadcast as Horovod's
`broadcast_parameters` / `broadcast_optimizer_state` do), learning-rate schedulers and
`ElasticSampler`s by their state dicts broadcast as objects."""

from __future__ import annotations

import copy
from typing import Any

import torch

from dtrain.horovod import basics
from dtrain.horovod.elastic.sampler import ElasticSampler
from dtrain.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)


class Handler:
    """Keeps one object's saved state (`saved`, a state dict) and syncs the live object."""

    def __init__(self, value: Any) -> None:
        self.value = value
        # A plain copy, even for samplers: no collective while the state is being built.
        self.saved: dict[str, Any] = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        """Copy the live object's state dict (tensors stay on their device)."""
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        """Load the saved state dict into the live object."""
        self.value.load_state_dict(self.saved)

    def sync_from(self, root_rank: int) -> None:
        """Give every process `root_rank`'s live state."""
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank))

    def set_value(self, value: Any) -> None:
        """A new object replaces the old one (``state.model = other``); it is saved at once."""
        self.value = value
        self.save()


class ModelHandler(Handler):
    """A `torch.nn.Module`: synced tensor by tensor, fused, like `broadcast_parameters`."""

    def sync_from(self, root_rank: int) -> None:
        """Every process takes `root_rank`'s parameters and buffers."""
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


class OptimizerHandler(Handler):
    """A `torch.optim.Optimizer` (a `DistributedOptimizer` too)."""

    def sync_from(self, root_rank: int) -> None:
        """Every process takes `root_rank`'s optimizer state and hyperparameters."""
        broadcast_optimizer_state(self.value, root_rank=root_rank)


class SamplerHandler(Handler):
    """An `ElasticSampler`: a save gathers every process's processed indices first, so the
    saved progress holds what `record_indices` recorded anywhere."""

    def save(self) -> None:
        """Save the sampler's state with the processed indices of every process."""
        state = copy.deepcopy(self.value.state_dict())
        if basics.is_initialized() and basics.size() > 1:
            everyone = allgather_object(set(self.value.processed_indices))
            state["processed_indices"] = sorted(set().union(*everyone))
        self.saved = state


_HANDLERS: list[tuple[type, type[Handler]]] = [
    (torch.nn.Module, ModelHandler),
    (torch.optim.Optimizer, OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, Handler),
    (ElasticSampler, SamplerHandler),
]


def handler_for(value: Any) -> Handler | None:
    """The handler for `value`'s kind, or None for a plain Python value."""
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None
