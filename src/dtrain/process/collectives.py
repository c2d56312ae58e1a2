"""The few host-side collectives the Engine and its checkpoints use, over a given group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """`value` from every process of `group`, in rank order (one in a one-process job)."""
    if not dist.is_initialized():
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def gather_to_main(value: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """`value` from every process of `group`, in rank order, on the group's first rank
    (None on the others): unlike `gather_objects`, no rank but the first holds them all."""
    if not dist.is_initialized():
        return [value]
    me, size = rank_in(group)
    everyone: list[Any] | None = [None] * size if me == 0 else None
    dist.gather_object(value, everyone, group=group, group_dst=0)
    return everyone


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every process of `group` (no-op in a one-process job)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def rank_in(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); (0, 1) in a one-process job."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
