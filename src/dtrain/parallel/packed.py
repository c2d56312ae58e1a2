"""Packed column-wise tensor parallelism: a Linear whose output stacks K parts, [q; k; v].

A fused projection such as nanoGPT's ``c_attn = nn.Linear(d, 3 * d)`` stacks its parts
along the output rows, and the forward splits the output into them. A plain column split
gives rank 0 the first rows, all of q and half of k; here each part is split over the T
ranks by itself, so rank r computes the rows [q_r; k_r; v_r] and its output splits into
its own slice of every part (Hugging Face's ``packed_colwise``). The forward must split
the output by the number of parts (``chunk(3, -1)``) or by a size read from the output,
not by the whole model's width.

The weight keeps its canonical row order, split by rows over the ranks like any column
split (a ``Shard(0)`` DTensor), so its state dict, checkpoints (whole or sharded) and a
resharded load see the layer as one process does. Each forward first exchanges rows so
that every rank holds its packed rows, one all-to-all over the tensor-parallel ranks
(about a third of the local rows for [q; k; v] over 2 ranks); backward sends the
gradient back the same way. That exchange is the price of the canonical layout: a
weight stored in packed order would reach checkpoints and DCP's resharding permuted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel


@dataclass(frozen=True)
class RowExchange:
    """How one rank's block of canonical rows becomes its packed rows.

    Rank j holds rows [j * B, (j + 1) * B) of the weight (B = rows / T); rank r computes
    rows k * P + [r * S, (r + 1) * S) of every part k (P = rows / K, S = P / T). Each
    rank sends its rows grouped by the rank that computes them; what a rank receives,
    in rank order, is its packed rows in order.
    """

    order: torch.Tensor
    """This rank's local rows, grouped by destination rank (stable: ascending within)."""
    send: list[int]
    """How many of them go to each rank."""
    receive: list[int]
    """How many rows come from each rank."""


def row_exchange(rows: int, parts: int, ranks: int, rank: int) -> RowExchange:
    """The exchange for a weight of `rows` output rows packing `parts` parts, on `rank` of
    `ranks` (each part's rows must divide by `ranks`)."""
    every = torch.arange(rows)
    per_part = rows // parts
    destination = (every % per_part) // (per_part // ranks)
    holder = every // (rows // ranks)
    mine = holder == rank
    return RowExchange(
        order=torch.argsort(destination[mine], stable=True),
        send=torch.bincount(destination[mine], minlength=ranks).tolist(),
        receive=torch.bincount(holder[destination == rank], minlength=ranks).tolist(),
    )


class PackedColwiseParallel(ColwiseParallel):
    """Split an `nn.Linear` whose output rows stack `parts` parts: each part by columns over
    the ranks on its own (see the module docstring). The input is replicated, the output
    is this rank's packed rows as a local tensor, as with `ColwiseParallel`."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        exchange = row_exchange(
            module.out_features, self.parts, device_mesh.size(), device_mesh.get_local_rank()
        )
        # The class carries the packed forward; parameters, hooks and state dict keys stay.
        module.__class__ = PackedLinear
        module.parts = self.parts
        module.exchange = exchange
        return module

    def __repr__(self) -> str:
        return f"PackedColwiseParallel(parts={self.parts})"


class PackedLinear(nn.Linear):
    """An `nn.Linear` split by `PackedColwiseParallel`: its weight and bias are canonical
    row blocks (DTensors); its forward computes this rank's packed output rows."""

    parts: int
    exchange: RowExchange

    def forward(self, input: DTensor) -> DTensor:  # noqa: A002 - nn.Linear's name
        """(..., in) replicated over the ranks -> (..., out / T), rows [q_r; k_r; v_r]; the
        style's hooks made the input a replicated DTensor and take the output's local part."""
        mesh = input.device_mesh
        # Each rank's rows give part of the input's gradient: the ranks' parts are summed.
        x = input.to_local(grad_placements=[Partial()])
        weight = self.weight.to_local()
        if self.bias is None:
            packed = _exchange(weight, self.exchange, mesh)
            out = F.linear(x, packed)
        else:
            # One exchange for both: the bias travels as one more column of its row.
            rows = torch.cat([weight, self.bias.to_local().unsqueeze(1)], dim=1)
            packed = _exchange(rows, self.exchange, mesh)
            out = F.linear(x, packed[:, :-1], packed[:, -1])
        return DTensor.from_local(out, mesh, [Shard(-1)], run_check=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}"


def _exchange(rows: torch.Tensor, exchange: RowExchange, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's packed rows from every rank's canonical block (differentiable)."""
    if mesh.size() == 1:
        return rows
    outgoing = rows.index_select(0, exchange.order.to(rows.device))
    return _AllToAll.apply(outgoing, exchange.send, exchange.receive, mesh.get_group())


class _AllToAll(torch.autograd.Function):
    """Send `send[r]` rows to each rank r and receive `receive[r]` from it, in rank order;
    backward sends the gradient rows back the same way reversed."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any
    ) -> torch.Tensor:
        ctx.exchange = send, receive, group
        return _all_to_all(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send, receive, group = ctx.exchange
        return _all_to_all(grad, receive, send, group), None, None, None


def _all_to_all(
    rows: torch.Tensor, send: list[int], receive: list[int], group: Any
) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
    return out
