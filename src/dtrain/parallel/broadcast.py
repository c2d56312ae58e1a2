"""Start every rank from one model: rank 0's parameters and buffers, sent to all.

Scripts build their model on every rank, and not always alike: nanoGPT seeds each rank
with ``1337 + rank`` before building it, a Hugging Face model may draw its initial values
from an unseeded generator. DDP broadcasts rank 0's state when it wraps a model; sharded,
split and tensor-parallel layouts do not, so each rank would keep its own initial values
and training would start from a mix of models. `broadcast_model` runs once at setup,
before anything is sharded or split, so that every layout starts from the same model.

Every tensor arrives bit for bit, whatever its dtype: a bucket holds one dtype and travels
as its raw bytes, so nothing is cast on the way (a complex rotary table keeps its imaginary
part, an int64 counter above 2**53 its low bits) and the backend needs no type of its own
for it (gloo cannot broadcast int16, NCCL has no complex or bool type).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 32 * 2**20
"""Tensors are sent in flat buckets of about this size (one collective per bucket)."""


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by dtype into lists of at most about BUCKET_BYTES each."""
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for t in tensors:
        lists = by_dtype.setdefault(t.dtype, [[]])
        if lists[-1] and sum(x.nbytes for x in lists[-1]) + t.nbytes > BUCKET_BYTES:
            lists.append([])
        lists[-1].append(t)
    return [bucket for lists in by_dtype.values() for bucket in lists]


def broadcast_bytes(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Overwrite the contiguous `tensor` with global rank `src`'s, as its raw bytes (exact
    for every dtype); a collective over `group`."""
    dist.broadcast(tensor.view(-1).view(torch.uint8), src=src, group=group)


@torch.no_grad()
def broadcast_tensors(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Overwrite each of `tensors` with the values `group`'s first rank holds in its place.

    Every rank of `group` calls it with tensors of the same shapes and dtypes, in the same
    order. The bytes travel through `device` (the backend's device: NCCL cannot send host
    memory), one bucket at a time, so at most one bucket is held there beyond the tensors.
    """
    if not tensors or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for bucket in _buckets(tensors):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
        broadcast_bytes(flat, source, group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            t.copy_(part.view_as(t))
        # Free this bucket before the next one is built: one bucket at a time at the peak.
        del flat, part


def broadcast_model(
    model: nn.Module, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Overwrite `model`'s parameters and buffers with those of `group`'s first rank.

    Every rank of `group` calls it with a model of the same structure. Tensors on the
    meta device (not materialised yet) are skipped; tied parameters are sent once (see
    :func:`broadcast_tensors` for `device`).
    """
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        tensors.append(t)
    broadcast_tensors(tensors, group, device)
