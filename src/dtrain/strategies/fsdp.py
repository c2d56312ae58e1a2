"""`zero2` and `zero3` (alias `fsdp`): PyTorch FSDP2 `fully_shard` over a 1-D DeviceMesh.

ZeRO (Rajbhandari et al., SC'20) stage 2 shards gradients and optimizer state; stage 3
also shards the parameters, gathering each block's parameters just before its forward
and backward and freeing them after. With FSDP2 the difference is one switch:
`reshard_after_forward=False` keeps a block's gathered parameters from forward to
backward (stage 2), True frees them after forward (stage 3, 1.5x the traffic of DDP).

Per rank, fp32 Adam, psi parameters: stage 2 holds 4 psi + 12 psi / N between steps,
stage 3 16 psi / N (plus the gathered parameters of the blocks in flight).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.optim import Optimizer

from dtrain.errors import ConfigError
from dtrain.strategies.base import Strategy, register
from dtrain.strategies.blocks import find_blocks
from dtrain.strategies.dcp_state import gather_full_state, load_full_state
from dtrain.strategies.rebuild import group_names, rebuild


class FullyShardedBase(Strategy):
    """Shared by zero2 and zero3: shard each block, then the root; rebuild the optimizer."""

    multiprocess = True
    collective_forward = True
    reshard_after_forward: ClassVar[bool] = True
    handles_precision = True

    def setup(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"Strategy {self.name} shards parameters, but the model has none to train; "
                "use --strategy single or ddp for a model without trainable parameters."
            )
        device = self.topology.device
        names = group_names(optimizer, model) if optimizer is not None else []
        model = model.to(device)
        mesh = init_device_mesh(device.type, (self.topology.world_size,))
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
        }
        if self.config.precision == "bf16-mixed":
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        if self.config.cpu_offload:
            if device.type != "cuda":
                raise ConfigError(
                    "--cpu-offload moves sharded parameters, gradients and optimizer state "
                    "from the GPUs to host memory; without GPUs there is nothing to offload. "
                    "Drop the flag on the CPU."
                )
            options["offload_policy"] = CPUOffloadPolicy()
        blocks = find_blocks(model, self.config.blocks)
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        # Explicit prefetching: gather the next block while this one computes.
        for current, following in zip(blocks, blocks[1:], strict=False):
            current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]
            following.set_modules_to_backward_prefetch([current])  # type: ignore[operator]
        self.model = model
        return model, rebuild(optimizer, names, model) if optimizer is not None else None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the last micro-batch reduce-scatters."""
        assert self.model is not None
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        assert self.model is not None
        tensors, optimizer_state = gather_full_state(self.model, optimizer)
        if not self.topology.is_main:
            return None, None
        return tensors, optimizer_state

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        assert self.model is not None
        return load_full_state(self.model, tensors, optimizer, optimizer_state, strict)


@register
class Zero2(FullyShardedBase):
    """Gradients and optimizer state sharded; parameters stay gathered forward to backward."""

    name = "zero2"
    order = 31
    reshard_after_forward = False


@register
class Zero3(FullyShardedBase):
    """Parameters, gradients and optimizer state sharded (fully sharded data parallel)."""

    name = "zero3"
    aliases = ("fsdp",)
    order = 32
    supports_cpu_offload = True
