"""What the torch wrappers cost per step by themselves, measured on a one-rank group.

DDP's hooks and buckets, FSDP2's unit-by-unit gather and scatter bookkeeping, DTensor's
dispatch for tensor parallelism, a pipeline schedule's work per micro-batch: their Python
and copy work per step is not in the plain model's step, and on small models it is most
of the step. Each is timed here as the
wrapped model's step on a group of one rank (gloo, or NCCL on a GPU) less the plain
model's, at the same batch and threads: the collectives of one rank move nothing, so what
remains is the wrapper's own work. The cost model adds the link's time for the bytes on
top (`dtrain.plan.links`).
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dtrain.plan.source import Workload

WRAPPERS = ("ddp", "zero2", "zero3", "tensor", "pipeline")
"""The wrappers timed: DDP; FSDP2 keeping (zero2) or freeing (zero3) gathered parameters
after forward; the model's tensor-parallel plan (DTensor); a pipeline schedule, per
micro-batch (`pipeline_seconds`)."""
PIPELINE_MICROBATCHES = 4
"""Micro-batches of the one-stage schedule that `pipeline_seconds` times."""


def _ddp(model: nn.Module, mesh: object) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp(reshard: bool) -> Callable[[nn.Module, object], nn.Module]:
    def wrap(model: nn.Module, mesh: object) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from dtrain.parallel.blocks import find_blocks

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


def _one_step(
    work: Workload, model: nn.Module, optimizer: torch.optim.Optimizer, batch: object
) -> float:
    inputs, targets = batch  # type: ignore[misc]
    began = time.perf_counter()
    work.loss_fn(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if inputs.device.type == "cuda":
        torch.cuda.synchronize(inputs.device)  # calibration only, never a training step
    return time.perf_counter() - began


def _paired(
    work: Workload, plain: nn.Module, wrapped: nn.Module, batch: object, seconds: float
) -> float:
    """Median over rounds of (wrapped step - plain step), the two run back to back so a
    pause of the machine falls on both alike."""
    from dtrain.models.recipes import make_optimizer

    opt_plain = make_optimizer(work.optimizer, plain, 1e-12)
    opt_wrapped = make_optimizer(work.optimizer, wrapped, 1e-12)
    for _ in range(2):  # warm-up
        _one_step(work, plain, opt_plain, batch)
        _one_step(work, wrapped, opt_wrapped, batch)
    differences: list[float] = []
    spent = 0.0
    while len(differences) < 7 or (spent < seconds and len(differences) < 60):
        a = _one_step(work, plain, opt_plain, batch)
        b = _one_step(work, wrapped, opt_wrapped, batch)
        differences.append(b - a)
        spent += a + b
    return max(0.0, statistics.median(differences))


def pipeline_seconds(work: Workload, device: torch.device, seconds: float) -> float:
    """The pipeline schedule's own seconds per micro-batch (its forward and backward
    actions, the loss, the shape checks): a one-stage GPipe schedule of
    `PIPELINE_MICROBATCHES` micro-batches on the one-rank group, less as many plain
    steps of a micro-batch, paired round by round. The work is per micro-batch, not per
    sample, so micro-batches of one sample measure it where the compute, and its noise,
    is least (at 8 GPT samples a micro-batch the noise was larger than the work)."""
    batch = 1
    from dtrain.models.recipes import make_optimizer
    from dtrain.parallel.pipeline import Pipeline

    m = PIPELINE_MICROBATCHES
    plain = copy.deepcopy(work.model).to(device)
    opt_plain = make_optimizer(work.optimizer, plain, 1e-12)
    staged = copy.deepcopy(work.model).to(device)
    opt_staged = make_optimizer(work.optimizer, staged, 1e-12)
    pipeline = Pipeline({0: staged}, 1, "gpipe", m, dist.group.WORLD, device)
    inputs, targets = work.batch(batch * m, device)
    micro = (inputs[:batch], targets[:batch])

    def piped() -> float:
        began = time.perf_counter()
        pipeline.step(inputs, targets, work.loss_fn)
        opt_staged.step()
        opt_staged.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # calibration only, never a training step
        return time.perf_counter() - began

    for _ in range(2):  # warm-up (the first step fixes the schedule's shapes)
        piped()
        _one_step(work, plain, opt_plain, micro)
    differences: list[float] = []
    spent = 0.0
    while len(differences) < 7 or (spent < seconds and len(differences) < 60):
        a = sum(_one_step(work, plain, opt_plain, micro) for _ in range(m))
        b = piped()
        differences.append((b - a) / m)
        spent += a + b
    return max(0.0, statistics.median(differences))


def measure_overheads(
    work: Workload, device: torch.device, batch: int, seconds: float, wanted: set[str]
) -> dict[str, float]:
    """Seconds per step each wrapper in `wanted` adds at `batch` samples (0 where it
    cannot be applied to this model; nothing where no one-rank group can be made here)."""
    from torch.distributed.device_mesh import init_device_mesh

    wanted = wanted & set(WRAPPERS)
    if not wanted or dist.is_initialized():
        return {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device
            if device.type == "cuda" else None,
        )  # fmt: skip
    except (RuntimeError, ValueError):  # no group here: the wrappers' cost stays unknown
        return {}
    out: dict[str, float] = {}
    try:
        mesh = init_device_mesh(device.type, (1,))
        data = work.batch(batch, device)
        plain = copy.deepcopy(work.model).to(device)
        for name in sorted(wanted - {"pipeline"}):
            try:
                model = BUILDERS[name](copy.deepcopy(work.model).to(device), mesh)
            except Exception:  # the model does not take this wrapper: nothing to add
                continue
            out[name] = _paired(work, plain, model, data, seconds)
            del model
        if "pipeline" in wanted:
            out["pipeline"] = pipeline_seconds(work, device, seconds)
    finally:
        gc.collect()  # no DDP or FSDP object may outlive the group (a gloo teardown crash)
        dist.destroy_process_group()
    return out
