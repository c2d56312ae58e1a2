"""Gradient clipping by the global norm of a model whose gradients are spread over ranks.

The norm is the L2 norm of the whole model's gradient, the one `single` computes with
``torch.nn.utils.clip_grad_norm_``. Each rank sums the squares of the gradient it holds:
a DTensor gradient's local shard counts once per rank along the mesh dimensions it is
sharded (or pending a sum) over and is summed over them; a replicated one counts once. The
stages of a pipeline hold different parameters, so their sums are added over the pipeline
group as well. Gradients are then scaled in place by ``min(1, max_norm / (norm + 1e-6))``,
as torch does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(grad: torch.Tensor) -> tuple[torch.Tensor, tuple[dist.ProcessGroup, ...]]:
    """This rank's part of `grad` and the groups its squares must be summed over."""
    if not isinstance(grad, DTensor):
        return grad, ()
    mesh = grad.device_mesh
    groups = tuple(
        mesh.get_group(dim) for dim, p in enumerate(grad.placements) if not p.is_replicate()
    )
    return grad.to_local(), groups


def global_grad_norm(
    parameters: Iterable[nn.Parameter], across: Sequence[dist.ProcessGroup] = ()
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the global L2 norm of the parameters' gradients as a 0-d tensor, float32 or wider,
    the local gradient tensors); a collective over the groups the gradients are spread over and
    over `across` (ranks holding different parameters, such as pipeline stages)."""
    sums: dict[tuple[dist.ProcessGroup, ...], torch.Tensor] = {}
    local_grads: list[torch.Tensor] = []
    device: torch.device | None = None
    for param in parameters:
        if param.grad is None:
            continue
        local, groups = _local(param.grad)
        local_grads.append(local)
        device = device or local.device
        # At least float32 (bf16 and fp16 squares overflow or lose the sum), float64 kept.
        wide = torch.promote_types(local.dtype, torch.float32)
        square = torch.linalg.vector_norm(local, dtype=wide).square()
        sums[groups] = sums[groups] + square if groups in sums else square
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, square in sums.items():
        for group in groups:
            dist.all_reduce(square, group=group)
        total = total + square
    for group in across:
        dist.all_reduce(total, group=group)
    return total.sqrt(), local_grads


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    across: Sequence[dist.ProcessGroup] = (),
) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm`; return the norm
    before clipping (on the device, not read back)."""
    norm, grads = global_grad_norm(parameters, across)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return norm
