"""`TorchState`: a model, an optimizer and anything else, kept as attributes."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.horovod.elastic.handlers import Handler, handler_for
from dtrain.horovod.elastic.state import ObjectState


class TorchState(ObjectState):
    """The state of PyTorch training: ``state.model``, ``state.optimizer`` and every
    keyword argument as an attribute (``state.epoch``, ``state.batch``, ...).

    Models, optimizers, learning-rate schedulers and `ElasticSampler`s (given under any
    name) are saved by their state dicts and synchronised as Horovod does; other values
    are plain Python objects (see `ObjectState`).

    Args:
        model: a `torch.nn.Module`, or None.
        optimizer: a `torch.optim.Optimizer` (or `hvd.DistributedOptimizer`), or None.
        **kwargs: more objects to keep.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        # ``state.optimizer = new_optimizer`` tracks the new object, as in Horovod.
        if name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        """Save every object's state dict and the plain values, in memory."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Load the saved state dicts and values back into the live objects."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync_from(self, root_rank: int) -> None:
        """Every process takes `root_rank`'s models, optimizers, schedulers, samplers and
        saved plain values."""
        for handler in self._handlers.values():
            handler.sync_from(root_rank)
        super().sync_from(root_rank)

    def snapshot(self) -> dict[str, Any]:
        """The saved state dicts (by attribute name) and plain values."""
        saved = {name: handler.saved for name, handler in self._handlers.items()}
        return {**super().snapshot(), "state_dicts": saved}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Make `snapshot` the saved state and load it into the live objects."""
        for name, saved in snapshot.get("state_dicts", {}).items():
            if name in self._handlers:
                self._handlers[name].saved = saved
                self._handlers[name].restore()
        super().load_snapshot(snapshot)
