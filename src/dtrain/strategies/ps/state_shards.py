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
                    full[key.start : key.start + key.numel] = value
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
    shard: ServerShard,
    values: torch.Tensor,
    params: list[nn.Parameter],
    loaded: dict[int, dict[str, Any]] | None,
) -> dict[str, Any]:
    """One server's part of the parameters (`values`: every parameter, flat, in the
    workers' layout) and of the `loaded` optimizer state (None: the server keeps its own)."""
    flat = torch.empty(shard.numel, dtype=values.dtype)
    for bucket in shard.buckets:
        flat[bucket.offset : bucket.offset + bucket.numel] = values[
            bucket.start : bucket.start + bucket.numel
        ]
    if loaded is None:
        return {"params": flat, "state": None}
    states: dict[int, dict[str, Any]] = {}
    for i, key in enumerate(shard.keys):
        if key.param not in loaded:
            continue
        numel = params[key.param].numel()
        states[i] = {
            name: v.detach().reshape(-1)[key.start : key.start + key.numel].cpu().clone()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel
            else v
            for name, v in loaded[key.param].items()
        }
    return {"params": flat, "state": states}
