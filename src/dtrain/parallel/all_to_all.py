"""Tokens sent to the ranks of their experts and back, by all-to-all (expert parallelism).

Each rank of an expert-parallel group holds `local` of the layer's experts (rank r the
experts r*local .. (r+1)*local - 1). A rank's tokens, each paired with one of its chosen
experts, are sorted by expert and sent to the experts' ranks with one
``all_to_all_single`` (uneven splits: how many pairs go to each rank, agreed first by an
all-to-all of the per-expert counts); the experts compute what they received, and a second
all-to-all sends the outputs back in the order they came. Both are differentiable: the
backward of an all-to-all is the same all-to-all with the splits swapped, so every rank
runs the same collectives in backward too (one with no tokens sends and receives nothing,
but takes part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.parallel.collective_timing import CollectiveTiming, timed


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
        timing: CollectiveTiming | None,
    ) -> torch.Tensor:
        ctx.splits = (in_splits, out_splits)
        ctx.group, ctx.timing = group, timing
        return _exchange(x, out_splits, in_splits, group, timing)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _exchange(grad, out_splits, in_splits, ctx.group, ctx.timing), None, None, None, None


def _exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    timing: CollectiveTiming | None,
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with timed(timing):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


ExpertCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows (n, dim), each row's local expert (n,)) -> the experts' outputs (n, dim)."""


def dispatch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
    compute: ExpertCompute,
    timing: CollectiveTiming | None = None,
) -> torch.Tensor:
    """Each token of `hidden` (T, dim) through its chosen experts (`top_k_index`, (T, K),
    over all `num_experts`), weighted by `top_k_weights` (T, K) and summed: what one
    process computes with every expert, here with the experts spread over `group`;
    `compute` runs this rank's experts on the rows sent to it. The all-to-alls tell
    `timing` when they start and end (the breakdown counts them as communication)."""
    ranks = dist.get_world_size(group)
    local = num_experts // ranks
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=num_experts)
    received = torch.empty_like(counts)
    by_source = received.view(ranks, local)  # (source, local expert) counts
    with timed(timing):  # the splits both ways, read on the host at once (one wait)
        dist.all_to_all_single(received, counts, group=group)
        both = torch.stack([counts.view(ranks, local).sum(1), by_source.sum(1)])
        send, recv = both.tolist()
    rows = _AllToAll.apply(hidden[token], recv, send, group, timing)
    experts = torch.repeat_interleave(
        torch.arange(local, device=hidden.device).repeat(ranks),
        by_source.reshape(-1),
        output_size=sum(recv),  # known on the host: no wait for the device
    )
    outputs = _AllToAll.apply(compute(rows, experts), send, recv, group, timing)
    weighted = outputs * top_k_weights.reshape(-1)[order, None].to(outputs.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype))
