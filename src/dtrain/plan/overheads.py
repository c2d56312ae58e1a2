"""What the torch wrappers cost per step by themselves, measured on a one-rank group.

DDP's hooks and buckets, FSDP2's unit-by-unit gather and scatter bookkeeping, DTensor's
dispatch for tensor parallelism: their Python and copy work per step is not in the plain
model's step, and on small models it is most of the step. Each is timed here as the
wrapped model's step on a group of one rank (gloo, or NCCL on a GPU) less the plain
model's, at the same batch and threads: the collectives of one rank move nothing, so what
remains is the wrapper's own work. The cost model adds the link's time for the bytes on
top (`dtrain.plan.links`).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dtrain.plan.source import Workload

WRAPPERS = ("ddp", "zero2", "zero3", "tensor")
"""The wrappers timed: DDP; FSDP2 keeping (zero2) or freeing (zero3) gathered parameters
after forward; the model's tensor-parallel plan (DTensor)."""


def _ddp(model: nn.Module, mesh: object) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp(reshard: bool) -> Callable[[nn.Module, object], nn.Module]:
    def wrap(model: nn.Module, mesh: object) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from dtrain.strategies.blocks import find_blocks

        for block in find_blocks(model):
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model

    return wrap


def _tensor(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    from dtrain.parallel.tensor_plan import plan_of

    parallelize_module(model, mesh, plan_of(model, 1))
    return model


BUILDERS: dict[str, Callable[[nn.Module, object], nn.Module]] = {
    "ddp": _ddp,
    "zero2": _fsdp(False),
    "zero3": _fsdp(True),
    "tensor": _tensor,
}


def measure_overheads(
    work: Workload,
    device: torch.device,
    batch: int,
    seconds: float,
    wanted: set[str],
    time_step: Callable[..., object],
) -> dict[str, float]:
    """Seconds per step each wrapper in `wanted` adds at `batch` samples (0 where it
    cannot be applied to this model, or a process group already exists here)."""
    from torch.distributed.device_mesh import init_device_mesh

    wanted = wanted & set(WRAPPERS)
    if not wanted or dist.is_initialized():
        return {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    out: dict[str, float] = {}
    try:
        mesh = init_device_mesh(device.type, (1,))
        plain = time_step(work, copy.deepcopy(work.model).to(device), batch, device, seconds)
        base = plain.forward + plain.backward + plain.optimizer  # type: ignore[attr-defined]
        for name in sorted(wanted):
            try:
                model = BUILDERS[name](copy.deepcopy(work.model).to(device), mesh)
            except Exception:  # the model does not take this wrapper: nothing to add
                continue
            step = time_step(work, model, batch, device, seconds)
            total = step.forward + step.backward + step.optimizer  # type: ignore[attr-defined]
            out[name] = max(0.0, total - base)
            del model
    finally:
        gc.collect()  # no DDP or FSDP object may outlive the group (a gloo teardown crash)
        dist.destroy_process_group()
    return out
