"""`zero2` and `zero3` (alias `fsdp`): PyTorch FSDP2 `fully_shard` over the data-parallel ranks.

ZeRO (Rajbhandari et al., SC'20) stage 2 shards gradients and optimizer state; stage 3
also shards the parameters, gathering each block's parameters just before its forward
and backward and freeing them after. With FSDP2 the difference is one switch:
`reshard_after_forward=False` keeps a block's gathered parameters from forward to
backward (stage 2), True frees them after forward (stage 3, 1.5x the traffic of DDP).

Per rank, fp32 Adam, psi parameters: stage 2 holds 4 psi + 12 psi / N between steps,
stage 3 16 psi / N (plus the gathered parameters of the blocks in flight). Presets of the
mesh strategies: ``dp_shard = world size``; the sharding itself is
`dtrain.parallel.data_parallel.apply_fsdp`, shared with hybrid.
"""

from __future__ import annotations

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.degrees import Degrees
from dtrain.strategies.base import register
from dtrain.strategies.mesh import MeshStrategy


class FullyShardedBase(MeshStrategy):
    """Shared by zero2 and zero3: every rank shards the whole model."""

    @classmethod
    def layout(cls, config: Config, world_size: int) -> Degrees:
        return Degrees(dp_shard=world_size)


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
    reshard_after_forward = True
    supports_cpu_offload = True


@register
class HSDP(Zero3):
    """Hybrid sharded data parallel: FSDP2 on a 2-D mesh, each replica's state sharded over
    `--shard-size` ranks (default: one machine's processes) and the shard groups
    replicating one another. Shards talk over the fast links inside a machine (gathers,
    reduce-scatters); across machines only the gradient all-reduce of each shard goes."""

    name = "hsdp"
    aliases = ()
    order = 33

    @classmethod
    def layout(cls, config: Config, world_size: int) -> Degrees:
        size = config.shard_size or config.nproc
        if size < 2 or world_size % size:
            raise ConfigError(
                f"--strategy hsdp shards each replica over --shard-size ranks, which must be "
                f"at least 2 and divide the {world_size} processes; got {size}. Pick a "
                "divisor such as the processes of one machine (--nproc), or use --strategy "
                "ddp for plain replicas."
            )
        return Degrees(dp_replicate=world_size // size, dp_shard=size)
