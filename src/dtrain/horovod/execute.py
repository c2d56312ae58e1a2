"""Starting negotiated operations as torch.distributed collectives.

The negotiation thread hands over batches of ready responses, each with this process's
`Operation` (its tensors) or None where this process joined and takes part with zeros.
Every process cuts a round's responses into the same batches (`plan`): consecutive
all-reduces of one process set, device, op and scaling are fused into one collective per
dtype up to the fusion threshold (HOROVOD_FUSION_THRESHOLD, 64 MiB by default; 0 turns
fusion off), as Horovod fuses them. Collectives are started asynchronously; each
operation's `finish` copies its share back and applies the post-scaling when it is waited
for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod.negotiation import Operation
from dtrain.horovod.reduction import ReduceOp, scale_, torch_op
from dtrain.horovod.requests import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    JOIN,
    REDUCESCATTER,
    dtype_of,
)
from dtrain.horovod.table import Response

Ready = list[tuple[Response, Operation | None]]


def slice_rows(rows: int, size: int) -> list[int]:
    """Rows each process keeps in a reduce-scatter: ``rows // size``, one more for the
    first ``rows % size`` (as in Horovod)."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


WIRE_DTYPES = {torch.int16: torch.int32}
"""dtypes neither gloo nor NCCL carry, and the wider one they travel as: every value fits,
and a sum cast back wraps exactly as an int16 sum does. Results come back in the caller's
dtype."""


def stage(tensor: torch.Tensor, devices: dict[str, str]) -> torch.Tensor:
    """`tensor` itself if the process group can send it as it is, else a contiguous copy on
    a device the group handles (a CPU tensor under an NCCL-only group goes to the GPU), in
    a dtype it carries (see `WIRE_DTYPES`)."""
    dtype = WIRE_DTYPES.get(tensor.dtype, tensor.dtype)
    if tensor.device.type in devices:
        device = tensor.device
        if dtype == tensor.dtype:
            return tensor if tensor.is_contiguous() else tensor.contiguous()
    elif "cpu" in devices:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    return tensor.to(device, dtype, copy=True).contiguous()


class Executor:
    """Runs ready responses on this process.

    Args:
        rank: this process's global rank.
        devices: device type -> backend of the data groups (see `stage`).
        group_of: the data process group of a process set, by its ranks.
        fusion_bytes: the fusion threshold; 0 runs every all-reduce on its own.
    """

    def __init__(
        self,
        rank: int,
        devices: dict[str, str],
        group_of: Callable[[tuple[int, ...]], dist.ProcessGroup],
        fusion_bytes: int,
    ) -> None:
        self.rank = rank
        self.devices = devices
        self.group_of = group_of
        self.fusion_bytes = fusion_bytes
        self.join_device = -1
        """The GPU joined processes make their zeros on, from `join(device)` (the calling
        thread's current GPU when -1)."""

    def plan(self, responses: list[Response]) -> list[list[Response]]:
        """Cut a round's responses into batches; consecutive all-reduces that may share a
        collective go into one batch. Every process cuts alike (it reads only responses)."""
        batches: list[list[Response]] = []
        current: list[Response] = []
        key: tuple | None = None
        nbytes = 0
        for response in responses:
            if response.kind != ALLREDUCE or response.error is not None or not self.fusion_bytes:
                batches.extend([current] if current else [])
                batches.append([response])
                current = []
                continue
            t = response.template
            k, size = (response.ranks, t.device, t.op, t.prescale, t.postscale), t.nbytes()
            if current and k == key and nbytes + size <= self.fusion_bytes:
                current.append(response)
                nbytes += size
                continue
            batches.extend([current] if current else [])
            current, key, nbytes = [response], k, size
        batches.extend([current] if current else [])
        return batches

    def run(self, ready: Ready) -> None:
        """Start the collectives of one batch (all of one kind)."""
        kind = ready[0][0].kind
        if kind == ALLREDUCE:
            self._allreduce(ready)
            return
        for response, operation in ready:
            assert operation is not None  # only all-reduces run without a local operation
            if kind in (BARRIER, JOIN):
                operation.start(
                    [], lambda last=response.last_joined: last if kind == JOIN else None
                )
            else:
                runner = {
                    ALLGATHER: self._allgather,
                    BROADCAST: self._broadcast,
                    ALLTOALL: self._alltoall,
                    REDUCESCATTER: self._reducescatter,
                }[kind]
                runner(response, operation)

    # --- all-reduce, fused --------------------------------------------------------------

    def _zeros(self, response: Response) -> list[torch.Tensor]:
        t = response.template
        device = torch.device("cpu")
        if t.device == "cuda":
            index = self.join_device if self.join_device >= 0 else torch.cuda.current_device()
            device = torch.device("cuda", index)
        return [
            torch.zeros(s, dtype=dtype_of(d), device=device)
            for d, s in zip(t.dtypes, t.shapes, strict=True)
        ]

    def _allreduce(self, ready: Ready) -> None:
        first = ready[0][0]
        t = first.template
        op, group = ReduceOp(t.op), self.group_of(first.ranks)
        buckets: dict[str, list[tuple[Operation | None, torch.Tensor]]] = {}
        for response, operation in ready:
            tensors = operation.tensors if operation is not None else self._zeros(response)
            for dtype, tensor in zip(response.template.dtypes, tensors, strict=True):
                buckets.setdefault(dtype, []).append((operation, tensor))
        works, shares = [], []
        with torch.no_grad():
            for members in buckets.values():
                if len(members) == 1:
                    wire = stage(members[0][1], self.devices)
                else:
                    wire = stage(torch.cat([m.reshape(-1) for _, m in members]), self.devices)
                scale_(wire, t.prescale)
                work = dist.all_reduce(wire, op=torch_op(op), group=group, async_op=True)
                offset = 0
                for operation, tensor in members:
                    shares.append((operation, work, wire, offset, tensor))
                    offset += tensor.numel()
                works.append(work)
        divisor = len(first.ranks) if op is ReduceOp.Average else 1
        for _, operation in ready:
            if operation is not None:
                mine = [s[1:] for s in shares if s[0] is operation]
                operation.start([m[0] for m in mine], _copy_back(mine, t.postscale, divisor))

    # --- the other collectives, one operation at a time --------------------------------

    def _allgather(self, response: Response, operation: Operation) -> None:
        group = self.group_of(response.ranks)
        works, pending = [], []
        with torch.no_grad():
            for i, tensor in enumerate(operation.tensors):
                counts = [response.requests[r].shapes[i][0] for r in response.ranks]
                wire = stage(tensor.detach(), self.devices)
                most = max(counts)
                if wire.shape[0] < most:
                    padded = wire.new_zeros((most, *wire.shape[1:]))
                    padded[: wire.shape[0]] = wire
                    wire = padded
                parts = [torch.empty_like(wire) for _ in response.ranks]
                works.append(dist.all_gather(parts, wire, group=group, async_op=True))
                pending.append((tensor, parts, counts))

        def finish() -> tuple[list[torch.Tensor], list[list[int]]]:
            gathered = [
                torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]).to(t.device, t.dtype)
                for t, parts, counts in pending
            ]
            return gathered, [counts for _, _, counts in pending]

        operation.start(works, finish)

    def _broadcast(self, response: Response, operation: Operation) -> None:
        output = operation.tensors[0]
        root = response.template.root
        with torch.no_grad():
            wire = stage(output.detach(), self.devices)
            group = self.group_of(response.ranks)
            work = dist.broadcast(wire, root, group=group, async_op=True)

        def finish() -> torch.Tensor:
            if wire.data_ptr() != output.data_ptr():
                with torch.no_grad():
                    output.copy_(wire)
            return output

        operation.start([work], finish)

    def _alltoall(self, response: Response, operation: Operation) -> None:
        tensor = operation.tensors[0]
        me = response.ranks.index(self.rank)
        sent = list(response.requests[self.rank].splits)
        received = [response.requests[r].splits[me] for r in response.ranks]
        with torch.no_grad():
            wire = stage(tensor.detach(), self.devices)
            out = wire.new_empty((sum(received), *wire.shape[1:]))
            work = dist.all_to_all_single(
                out,
                wire,
                output_split_sizes=received,
                input_split_sizes=sent,
                group=self.group_of(response.ranks),
                async_op=True,
            )
        operation.start([work], lambda: (out.to(tensor.device, tensor.dtype), received))

    def _reducescatter(self, response: Response, operation: Operation) -> None:
        t = response.template
        op, size = ReduceOp(t.op), len(response.ranks)
        me = response.ranks.index(self.rank)
        group = self.group_of(response.ranks)
        works, pending = [], []
        with torch.no_grad():
            for tensor in operation.tensors:
                wire = stage(tensor.detach(), self.devices)
                if wire.data_ptr() == tensor.data_ptr():
                    wire = wire.clone()
                scale_(wire, t.prescale)
                pieces = [
                    p.contiguous() for p in torch.split(wire, slice_rows(wire.shape[0], size))
                ]
                out = torch.empty_like(pieces[me])
                works.append(
                    dist.reduce_scatter(out, pieces, op=torch_op(op), group=group, async_op=True)
                )
                pending.append((tensor, out))
        divisor = size if op is ReduceOp.Average else 1

        def finish() -> list[torch.Tensor]:
            with torch.no_grad():
                return [
                    scale_(out, t.postscale, divisor).to(tensor.device, tensor.dtype)
                    for tensor, out in pending
                ]

        operation.start(works, finish)


def _copy_back(
    shares: list[tuple[Any, ...]], factor: float, divisor: int
) -> Callable[[], list[torch.Tensor]]:
    """The finish of an all-reduce: each output gets its slice of the reduced buffer, then
    the post-scaling and the division of an average."""

    def finish() -> list[torch.Tensor]:
        outputs = []
        with torch.no_grad():
            for _, wire, offset, output in shares:
                n = output.numel()
                if not (wire.data_ptr() == output.data_ptr() and offset == 0):
                    output.copy_(wire.reshape(-1)[offset : offset + n].view(output.shape))
                outputs.append(scale_(output, factor, divisor))
        return outputs

    return finish
