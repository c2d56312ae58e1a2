"""Optimizer state and parameters between the servers' flat shards and whole tensors.

A checkpoint holds whole parameters and optimizer state keyed by parameter (the standard
dtrain format); a server holds 1-D slices (keys). `merge` assembles what the servers
return into whole tensors; `split` cuts loaded parameters and state into each server's
keys. Per-element state (momentum, Adam's moments) is 1-D on a server and has the
parameter's shape in a checkpoint; anything else (Adam's step count) is copied as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.sharding import Plan, ServerShard


def merge(
    plan: Plan, params: list[nn.Parameter], per_server: list[dict[int, dict[str, Any]]]
) -> dict[int, dict[str, Any]]:
    """The servers' optimizer states (by key index) as whole tensors by parameter index."""
    state: dict[int, dict[str, Any]] = {}
    for shard, per_key in zip(plan.shards, per_server, strict=True):
        for key_index, values in per_key.items():
            key = shard.keys[key_index]
            merged = state.setdefault(key.param, {})
            for name, value in values.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    numel = params[key.param].numel()
                    full = merged.setdefault(name, torch.zeros(numel, dtype=value.dtype))
                    protocol.scatter_key(full, key.ranges, value)
                else:
                    merged[name] = value
    for index, values in state.items():
        shape = params[index].shape
        for name, value in values.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == 1
                and value.numel() == shape.numel()
            ):
                values[name] = value.view(shape)
    return state


def split(
    shard: ServerShard, params: list[nn.Parameter], loaded: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """One server's part of the parameters and of the `loaded` optimizer state."""
    flat = torch.empty(shard.numel, dtype=params[0].dtype)
    states: dict[int, dict[str, Any]] = {}
    for i, key in enumerate(shard.keys):
        param = params[key.param].detach().reshape(-1).cpu()
        flat[key.offset : key.offset + key.numel] = protocol.gather_key(param, key.ranges)
        if key.param in loaded:
            states[i] = {
                name: protocol.gather_key(v.reshape(-1).cpu(), key.ranges).clone()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param.numel()
                else v
                for name, v in loaded[key.param].items()
            }
    return {"params": flat, "state": states}
