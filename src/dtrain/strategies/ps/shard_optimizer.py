"""The user's optimizer over one server's shard, one optimizer per bucket.

The server rebuilds the optimizer worker 0 described (same class, same per-group
settings) over 1-D views of its flat buffer, one parameter per key; with one optimizer
per bucket, an update can run bucket by bucket and send each bucket as soon as it is
done. Every optimizer keeps all the user's param groups (empty ones included), so group
g is the user's group g everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.strategies.ps.handshake import Description
from dtrain.strategies.ps.optimizer import BY_NAME
from dtrain.strategies.ps.sharding import ServerShard
from dtrain.strategies.rebuild import restate


class ShardOptimizer:
    """Update a server's flat buffer bucket by bucket with the user's optimizer.

    Args:
        shard: the server's buckets and keys.
        flat: the server's buffer (its buckets back to back), updated in place.
        description: worker 0's optimizer class and per-group settings.
    """

    def __init__(self, shard: ServerShard, flat: torch.Tensor, description: Description) -> None:
        self.shard = shard
        self.params = [nn.Parameter(flat[k.offset : k.offset + k.numel]) for k in shard.keys]
        groups = range(len(description.settings))
        self.optimizers = [
            restate(
                BY_NAME[description.optimizer],
                description.settings,
                [[self.params[k] for k in b.keys if shard.keys[k].group == g] for g in groups],
                description.defaults,
            )
            for b in shard.buckets
        ]
        self._bucket_of_key = [b for b, bucket in enumerate(shard.buckets) for _ in bucket.keys]

    def set_settings(self, settings: list[dict[str, Any]], lr_scale: float) -> None:
        """Each param group's numeric settings (a worker's commit), its lr times `lr_scale`."""
        for optimizer in self.optimizers:
            for group, values in zip(optimizer.param_groups, settings, strict=True):
                group.update(values)
                group["lr"] = values["lr"] * lr_scale

    def step(self, b: int, grad: torch.Tensor, present: list[bool] | None = None) -> None:
        """Update bucket `b` with its gradient `grad` (laid out as the bucket); only the
        keys `present` marks (None: all) get a gradient, so the optimizer skips the others."""
        bucket = self.shard.buckets[b]
        stepping = False
        for k in bucket.keys:
            if present is None or present[k]:
                key = self.shard.keys[k]
                at = key.offset - bucket.offset
                self.params[k].grad = grad[at : at + key.numel]
                stepping = True
        if stepping:
            self.optimizers[b].step()
        for k in bucket.keys:
            self.params[k].grad = None

    def state(self) -> dict[int, dict[str, object]]:
        """Optimizer state of each key, by key index (tensors 1-D over the key)."""
        result = {}
        for k, param in enumerate(self.params):
            state = self.optimizers[self._bucket_of_key[k]].state
            if param in state:
                result[k] = dict(state[param])
        return result

    def load_state(self, states: dict[int, dict[str, object]]) -> None:
        """Replace the optimizer state with `states` (by key index; keys not in it start
        fresh)."""
        for k, param in enumerate(self.params):
            state = self.optimizers[self._bucket_of_key[k]].state
            if k in states:
                state[param] = dict(states[k])
            else:
                state.pop(param, None)
