"""A forward-only pass through the pipeline stages, for evaluation and inference.

Training runs through a `torch.distributed.pipelining` schedule, which fixes its
micro-batch shapes at the first step. Evaluation batches vary (the last one is short), so
evaluation relays whole batches stage to stage instead, sending each activation's shape
ahead of it, and hands the last stage's output to every rank of the pipeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_HEADER = 10  # dtype, ndim, then up to 8 sizes


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise TypeError(f"cannot relay a {t.dtype} tensor of {t.dim()} dimensions between stages")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=t.device)


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    dtype, ndim, *sizes = header.tolist()
    return torch.empty(sizes[:ndim], dtype=_DTYPES[dtype], device=device)


def _send(t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    dist.send(_header(t), dst=dst, group=group)
    dist.send(t.contiguous(), dst=dst, group=group)


def _recv(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    t = _empty_from(header, device)
    dist.recv(t, src=src, group=group)
    return t


def _broadcast(
    t: torch.Tensor | None, src: int, group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    header = _header(t) if t is not None else torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    out = t.contiguous() if t is not None else _empty_from(header, device)
    dist.broadcast(out, src=src, group=group)
    return out


@torch.no_grad()
def relay_forward(
    x: torch.Tensor,
    stages: dict[int, nn.Module],
    num_stages: int,
    group: dist.ProcessGroup,
    extras: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run `x` through every stage (stage s lives on pipeline rank s mod P), each stage
    also given `extras` (every rank holds the batch); every rank returns the last stage's
    output. `stages` maps this rank's stage indices to modules."""
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    to_global = lambda r: dist.get_global_rank(group, r)  # noqa: E731
    device = x.device
    for s in range(num_stages):
        if s % size != me:
            continue
        if s > 0 and (s - 1) % size != me:
            x = _recv(to_global((s - 1) % size), group, device)
        x = stages[s](x, **(extras or {}))
        if s < num_stages - 1 and (s + 1) % size != me:
            _send(x, to_global((s + 1) % size), group)
    last = (num_stages - 1) % size
    return _broadcast(x if me == last else None, to_global(last), group, device)
