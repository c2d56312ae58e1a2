"""The degrees of data, pipeline and tensor parallelism, and the named DeviceMesh over them.

One :class:`Degrees` says how many ways the job is split along each dimension: data
parallel as replicas (ddp, ``dp_replicate``) times shards (zero2/zero3, ``dp_shard``),
pipeline stages (``pp``) and tensor shards (``tp``). Every mesh strategy is a preset over
it; it is validated once (the product is the world size) and builds one named mesh.

Ranks are laid out pp-major, tp-minor (as torchtitan does): the tp ranks of a stage are
neighbours (same machine, fastest links), the dp replicas and shards of a stage come
next, and the pipeline stages are furthest apart (they exchange only activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Degrees:
    """How many ways the job is split along each dimension; the product is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas that each hold the whole (stage's, tp shard's) state (ddp)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP)."""
    pp: int = 1
    """Pipeline stages (ranks along the chain of layers)."""
    tp: int = 1
    """Tensor-parallel ranks splitting each layer's matrices."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "pp", "tp"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"The {name} degree must be at least 1, got {getattr(self, name)}."
                )

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: each reads a different share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.pp * self.tp

    @property
    def dp_enabled(self) -> bool:
        """True with more than one data-parallel rank."""
        return self.dp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """True when the data-parallel ranks shard the model state (FSDP)."""
        return self.dp_shard > 1

    @property
    def pp_enabled(self) -> bool:
        """True with more than one pipeline stage."""
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        """True with more than one tensor-parallel rank."""
        return self.tp > 1

    def describe(self) -> str:
        """``dp2 x pp2 x tp1`` (with ``(replicate 2 x shard 2)`` when both are used)."""
        dp = f"dp{self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp += f" (replicate {self.dp_replicate} x shard {self.dp_shard})"
        return f"{dp} x pp{self.pp} x tp{self.tp}"

    def mesh(self, device_type: str) -> ParallelMesh:
        """The named mesh over every rank (a collective: every rank must call it)."""
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        return ParallelMesh(self, init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS))


class ParallelMesh:
    """The named 4-D DeviceMesh of a :class:`Degrees`, with the data-parallel view (the
    replicate and shard dimensions together) that batches are sharded over."""

    def __init__(self, degrees: Degrees, mesh: DeviceMesh) -> None:
        self.degrees = degrees
        self.device_mesh = mesh
        self._dp_group = self._data_parallel_group()

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        return self.device_mesh[dims]

    def local_rank(self, dim: str) -> int:
        """This rank's coordinate along `dim`."""
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group along `dim`."""
        return self.device_mesh.get_group(dim)

    def rank_at(self, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        return int(self.device_mesh.mesh[pp, dp_replicate, dp_shard, tp])

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (replica-major)."""
        return self.local_rank("dp_replicate") * self.degrees.dp_shard + self.local_rank("dp_shard")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Every data-parallel rank of this rank's (stage, tp shard): the batch's readers."""
        return self._dp_group

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (shard), or 2-D (replicate, shard) for HSDP."""
        d = self.degrees
        if d.dp_replicate > 1 and d.dp_shard > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard" if d.dp_shard > 1 else "dp_replicate"]

    def _data_parallel_group(self) -> dist.ProcessGroup:
        d = self.degrees
        if d.dp_replicate == 1 or d.dp_shard == 1:
            return self.group("dp_shard" if d.dp_shard > 1 else "dp_replicate")
        # Both dimensions: one group per (stage, tp shard) over their product. Every rank
        # takes part in creating every group, as new_group requires.
        ranks = self.device_mesh.mesh.permute(0, 3, 1, 2).reshape(-1, d.dp).tolist()
        me = dist.get_rank()
        mine = None
        for members in ranks:
            group = dist.new_group(members)
            if me in members:
                mine = group
        assert mine is not None
        return mine


def degrees_for(
    strategy: str, nproc: int, dp: int | None, pp: int | None, tp: int | None, dp_mode: str = "ddp"
) -> Degrees:
    """The degrees `strategy` runs with on `nproc` processes, or a ConfigError that says why not.

    `pipeline` is pp only and `tensor` tp only (their degree defaults to --nproc); `hybrid`
    combines them, with dp defaulting to what is left of --nproc, replicated for
    ``dp_mode`` ddp and sharded for zero2/zero3.
    """
    for flag, value in (("--dp", dp), ("--pp", pp), ("--tp", tp)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}.")
    if strategy == "pipeline":
        _only(strategy, "--pp", {"--dp": dp, "--tp": tp})
        degrees = Degrees(pp=pp or nproc)
    elif strategy == "tensor":
        _only(strategy, "--tp", {"--dp": dp, "--pp": pp})
        degrees = Degrees(tp=tp or nproc)
    else:
        pp, tp = pp or 1, tp or 1
        if dp is None:
            if nproc % (pp * tp):
                raise ConfigError(
                    f"--pp {pp} x --tp {tp} = {pp * tp} does not divide --nproc {nproc}, so no "
                    "whole number of data-parallel replicas fits; make --nproc a multiple of "
                    "pp x tp."
                )
            dp = nproc // (pp * tp)
        if dp_mode == "ddp":
            degrees = Degrees(dp_replicate=dp, pp=pp, tp=tp)
        else:
            degrees = Degrees(dp_shard=dp, pp=pp, tp=tp)
    if degrees.world_size != nproc:
        raise ConfigError(
            f"--strategy {strategy} lays out {degrees.describe()} = {degrees.world_size} "
            f"processes, but --nproc is {nproc}; the product of the degrees must equal "
            f"--nproc. Use --nproc {degrees.world_size}, or change the degrees."
        )
    return degrees


def _only(strategy: str, allowed: str, others: dict[str, int | None]) -> None:
    given = [flag for flag, value in others.items() if value not in (None, 1)]
    if given:
        raise ConfigError(
            f"--strategy {strategy} splits the model along {allowed} only, but "
            f"{', '.join(given)} was given; use --strategy hybrid to combine data, pipeline "
            "and tensor parallelism."
        )
