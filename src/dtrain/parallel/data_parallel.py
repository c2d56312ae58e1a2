"""Data parallelism applied to a model: replicas (DDP, `replicate`) or shards (FSDP2).

One function per verb, each the only place its torch wrapper is configured:

- `apply_ddp`: PyTorch DistributedDataParallel (Li et al., VLDB 2020), bucketed ring
  all-reduce overlapped with backward, for a whole model replicated over the dp ranks.
- `apply_replicate`: the composable, FSDP2-based replicate, for replicas of parts that are
  themselves pipeline stages or hold DTensor (tensor-parallel) parameters.
- `apply_fsdp`: `fully_shard` (ZeRO stage 2 or 3, Rajbhandari et al., SC'20) block by block
  then the root, with explicit prefetching, mixed precision and CPU offload honoured the
  same way for every strategy that shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dtrain.errors import OFFLOAD_NEEDS_GPUS, ConfigError
from dtrain.parallel.broadcast import broadcast_tensors
from dtrain.parallel.compression import cast_dtype, register_compression
from dtrain.parallel.hierarchical import HostGroups, hierarchical_hook
from dtrain.parallel.materialize import materialize
from dtrain.step.precision import compute_dtype


@dataclass(frozen=True)
class ShardOptions:
    """What `apply_fsdp` configures, the same for zero2, zero3 and hybrid's sharded dp."""

    reshard_after_forward: bool
    """True frees a block's gathered parameters after its forward (ZeRO-3); False keeps
    them to backward (ZeRO-2)."""
    precision: str = "fp32"
    """``bf16-mixed`` (``fp16-mixed``): bf16 (fp16) parameters in compute, fp32 gradient
    reduction and outputs."""
    cpu_offload: bool = False
    """Keep the shards (parameters, gradients, optimizer state) in host memory."""
    prefetch: bool = True
    """Gather the next block's parameters while the current one computes."""
    grad_compression: str = "none"
    """--grad-compression: fp16 or bf16 reduce the gradients in that dtype (FSDP2's reduce
    dtype, for the reduce-scatter and, under hsdp, the all-reduce across replicas alike:
    it reduces both in one dtype)."""

    def fully_shard_kwargs(
        self, mesh: DeviceMesh, device: torch.device, root: bool
    ) -> dict[str, Any]:
        """The keyword arguments of `fully_shard` for these options on `mesh`, for a block
        or for the `root` (the whole model or a pipeline stage)."""
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        dtype = compute_dtype(self.precision)
        reduce_dtype = cast_dtype(self.grad_compression)
        if dtype is not None or reduce_dtype is not None:
            # Blocks hand bf16 (fp16) activations to each other; only the root's output
            # (what the loss sees) goes back to fp32. An fp32 output from every block would
            # reach the next bf16 layer norm, which the CPU kernels refuse.
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=dtype,
                reduce_dtype=reduce_dtype or torch.float32,
                output_dtype=torch.float32 if root and dtype is not None else None,
            )
        if self.cpu_offload:
            if device.type != "cuda":
                raise ConfigError(OFFLOAD_NEEDS_GPUS)
            kwargs["offload_policy"] = CPUOffloadPolicy()
        return kwargs


def apply_ddp(
    model: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    hosts: HostGroups | None = None,
    find_unused_parameters: bool = False,
    init_sync: bool = True,
    grad_compression: str = "none",
    leave: tuple[str, ...] = (),
) -> DistributedDataParallel:
    """`model` replicated over `group` with DistributedDataParallel; with `hosts`,
    gradients are averaged machine by machine (`dtrain.parallel.hierarchical`, which
    applies a cast --grad-compression itself), else compressed by `grad_compression`
    (`dtrain.parallel.compression`). `find_unused_parameters`: DDP's option of that name.
    `init_sync`: broadcast rank 0's parameters and buffers first (False where
    `dtrain.parallel.broadcast` already did). Buffers of a dtype the backend has no type
    for (an int16 counter) travel as raw bytes, at the same moments as DDP's own. `leave`:
    names of parameters DDP leaves alone (experts, reduced over their own ranks by
    `dtrain.parallel.expert_parallel`)."""
    if leave:
        _leave_to_caller(model, list(leave))
    uncarried = _buffers_as_bytes(model, group)
    wrapped = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        init_sync=init_sync,
        find_unused_parameters=find_unused_parameters,
    )
    if uncarried:
        if init_sync:  # DDP's first broadcast leaves them out too
            broadcast_tensors(uncarried, group, device)
        # As DDP syncs its own buffers: before each forward that builds a graph.
        model.register_forward_pre_hook(
            lambda *args: (
                broadcast_tensors(uncarried, group, device) if torch.is_grad_enabled() else None
            )
        )
    if hosts is not None:
        wrapped.register_comm_hook(hosts, hierarchical_hook)
    else:
        register_compression(wrapped, group, grad_compression)
    return wrapped


CARRIED = {
    torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
}  # fmt: skip
"""The dtypes DDP's own buffer broadcast can send over gloo and NCCL (gloo has no int16,
uint16, uint32, uint64 or float8)."""


def _buffers_as_bytes(model: nn.Module, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """`model`'s buffers of a dtype outside CARRIED, which DDP is told to leave alone (its
    broadcast before each forward would fail inside the backend); the caller broadcasts
    them as raw bytes in their place, as DDP would (`dtrain.parallel.broadcast`, which
    sends any dtype, contiguous or not)."""
    buffers = {n: b for n, b in model.named_buffers() if b.dtype not in CARRIED}
    if not buffers or dist.get_world_size(group) == 1:
        return []
    _leave_to_caller(model, list(buffers))
    return list(buffers.values())


def _leave_to_caller(model: nn.Module, names: list[str]) -> None:
    """Tell DDP to leave `names` alone, besides any the script told it to leave itself."""
    own = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, own + names)


def apply_replicate(
    units: list[nn.Module], blocks: list[list[nn.Module]], mesh: DeviceMesh
) -> None:
    """Replicate each unit (a whole model or a pipeline stage) over `mesh`, block by block
    (so each block's gradients are reduced as soon as its backward is done)."""
    # A private module of recent torch: imported here so `import dtrain` never needs it.
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for unit, inner in zip(units, blocks, strict=True):
        for block in inner:
            if any(p.requires_grad for p in block.parameters()):
                replicate(block, mesh=mesh)
        replicate(unit, mesh=mesh)


def apply_fsdp(
    units: list[nn.Module],
    blocks: list[list[nn.Module]],
    mesh: DeviceMesh,
    options: ShardOptions,
    device: torch.device,
    leave: frozenset[nn.Parameter] = frozenset(),
) -> None:
    """Shard each unit (a whole model or a pipeline stage) over `mesh`: its blocks first,
    then the unit itself (which takes the remaining parameters), then link the blocks for
    explicit prefetching (forward: the next block; backward: the previous one).

    The units may be anywhere (host memory, the meta device): `fully_shard` moves each
    block's tensors to `device` as it shards them, and the whole tensors it replaced are
    released block by block (the user's optimizer still holds them until setup repoints
    it), so the device never holds more than the shards and one whole block. A unit built
    on the meta device then gets storage for its shards only (`materialize`).
    `leave`: parameters FSDP leaves alone (experts, held by their own ranks).
    """
    for unit in units:
        _make_contiguous(unit)
    home = torch.device("cpu") if options.cpu_offload else device
    for unit, inner in zip(units, blocks, strict=True):
        trainable = [b for b in inner if any(p.requires_grad for p in b.parameters())]
        for block in trainable:
            _shard(block, options.fully_shard_kwargs(mesh, device, root=False), leave)
        _shard(unit, options.fully_shard_kwargs(mesh, device, root=True), leave)
        materialize(unit, home)
        if options.prefetch:
            for current, following in zip(trainable, trainable[1:], strict=False):
                current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]
                following.set_modules_to_backward_prefetch([current])  # type: ignore[operator]


@torch.no_grad()
def _shard(module: nn.Module, kwargs: dict[str, Any], leave: frozenset[nn.Parameter]) -> None:
    """`fully_shard(module)` but for the parameters in `leave`, then release the whole
    tensors of the parameters it replaced with shards (a tensor-parallel slice or a meta
    tensor has nothing to release)."""
    before = dict(module.named_parameters())
    ignored = {p for p in before.values() if p in leave}
    fully_shard(module, **kwargs, ignored_params=ignored or None)
    now = dict(module.named_parameters())
    for name, param in before.items():
        if now.get(name) is not param and not isinstance(param, DTensor) and not param.is_meta:
            param.data = param.data.new_empty(0)


@torch.no_grad()
def _make_contiguous(module: nn.Module) -> None:
    """Give every non-contiguous parameter (a transposed view, say) contiguous storage of
    the same values, which FSDP2 needs to shard it; the parameter object is kept, so the
    optimizer and the user's references still hold it."""
    for param in module.parameters():
        if not param.is_contiguous():
            param.data = param.data.contiguous()
