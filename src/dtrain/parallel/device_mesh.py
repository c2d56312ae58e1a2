"""The named 5-D DeviceMesh over a :class:`Degrees` ("pp", "dp_replicate", "dp_shard", "cp",
"tp").

Ranks are laid out pp-major, tp-minor (as torchtitan does): the tp ranks of a stage are
neighbours (same machine, fastest links), then the context-parallel ranks that share each
sample (their attention exchanges keys and values every layer), the dp replicas and shards
of a stage next, and the pipeline stages are furthest apart (they exchange only
activations).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dtrain.parallel.degrees import Degrees

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelMesh:
    """The named 5-D DeviceMesh of a :class:`Degrees`, with the data-parallel view (the
    replicate and shard dimensions together) that batches are sharded over, and the view
    gradients are averaged over (data-parallel and context-parallel ranks together)."""

    def __init__(self, degrees: Degrees, mesh: DeviceMesh) -> None:
        self.degrees = degrees
        self.device_mesh = mesh
        d = degrees
        # Every rank takes part in creating every group, as new_group requires.
        self._dp_group = (
            self.group("dp_shard" if d.dp_shard > 1 else "dp_replicate")
            if d.dp_replicate == 1 or d.dp_shard == 1
            else _groups_over(mesh, (0, 3, 4, 1, 2), d.dp)
        )
        self._grad_group = (
            _groups_over(mesh, (0, 4, 1, 2, 3), d.dp * d.cp) if d.cp_enabled else self._dp_group
        )

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        return self.device_mesh[dims]

    def local_rank(self, dim: str) -> int:
        """This rank's coordinate along `dim`."""
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group along `dim`."""
        return self.device_mesh.get_group(dim)

    def rank_at(
        self, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, cp: int = 0, tp: int = 0
    ) -> int:
        """The global rank at these coordinates."""
        return int(self.device_mesh.mesh[pp, dp_replicate, dp_shard, cp, tp])

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (replica-major)."""
        return self.local_rank("dp_replicate") * self.degrees.dp_shard + self.local_rank("dp_shard")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Every data-parallel rank of this rank's (stage, context slice, tp shard): the
        batch's readers."""
        return self._dp_group

    @property
    def grad_group(self) -> dist.ProcessGroup:
        """The ranks whose gradients are averaged: the data-parallel ranks, with context
        parallelism times the context-parallel ranks (each computed its slice's share)."""
        return self._grad_group

    @functools.cached_property
    def _hsdp_over_context(self) -> DeviceMesh:
        """hsdp's mesh under --cp, made (a collective) the first time FSDP asks for it."""
        return _hsdp_grid(self)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards (or `replicate` replicates) over: 1-D (shard, the context
        ranks, or shard x cp flattened), or 2-D (replicate, shard; with context parallelism
        replicate, shard x cp) for HSDP."""
        d = self.degrees
        if d.cp_enabled and d.dp_replicate > 1 and not d.tp_enabled:
            return self._hsdp_over_context
        if d.cp_enabled and d.dp == 1:  # a slice of the mesh, as tensor parallelism needs
            return self.device_mesh["cp"]
        if d.cp_enabled and d.tp_enabled:  # hybrid: (dp, cp), averaged over both
            return self.device_mesh["dp_shard" if d.dp_shard > 1 else "dp_replicate", "cp"]
        if d.cp_enabled:
            return DeviceMesh.from_group(
                self._grad_group, self.device_mesh.device_type, mesh_dim_names=("dp_cp",)
            )
        if d.dp_replicate > 1 and d.dp_shard > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard" if d.dp_shard > 1 else "dp_replicate"]


@dataclass(frozen=True)
class ExpertMesh:
    """Where expert parallelism puts the experts: the mesh and placements of their
    DTensors, the group each MoE layer exchanges its tokens over (the --ep ranks), and the
    group of ranks holding the same experts (None when the ep ranks are all the
    data-parallel ranks)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    group: dist.ProcessGroup
    replicas: dist.ProcessGroup | None

    @property
    def ep(self) -> int:
        """Ranks the experts are split over."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's index among them: it holds the rank-th 1/ep of each layer's experts."""
        return dist.get_rank(self.group)


def expert_mesh(mesh: ParallelMesh) -> ExpertMesh:
    """The experts' mesh over the data-parallel ranks of `mesh` (a collective where a mesh
    of its own is made; the layouts with experts are data-parallel only). Split over all
    the data-parallel ranks, or over each hsdp shard group, the experts' DTensors live on
    the mesh the other parameters' do (so torch's own clip_grad_norm_ can add their norms);
    otherwise on an (ep_replicate, ep) mesh of groups of ep neighbouring ranks."""
    d = mesh.degrees
    assert d.world_size == d.dp, "expert parallelism lays out data-parallel ranks only"
    dp_mesh = mesh.dp_mesh
    if d.ep == d.dp and dp_mesh.ndim == 1:
        return ExpertMesh(dp_mesh, (Shard(0),), dp_mesh.get_group(), None)
    if dp_mesh.ndim == 2 and d.ep == d.dp_shard:  # hsdp: the experts over each shard group
        group, replicas = dp_mesh.get_group("dp_shard"), dp_mesh.get_group("dp_replicate")
        return ExpertMesh(dp_mesh, (Replicate(), Shard(0)), group, replicas)
    own = init_device_mesh(
        dp_mesh.device_type, (d.dp // d.ep, d.ep), mesh_dim_names=("ep_replicate", "ep")
    )
    group, replicas = own.get_group("ep"), own.get_group("ep_replicate")
    return ExpertMesh(own, (Replicate(), Shard(0)), group, replicas)


def _hsdp_grid(mesh: ParallelMesh) -> DeviceMesh:
    """hsdp with context parallelism: replicas (dim 0) of groups that shard over their
    data- and context-parallel ranks together (dim 1), from new groups (collective)."""
    d, root = mesh.degrees, mesh.device_mesh
    across = _groups_over(root, (0, 2, 3, 4, 1), d.dp_replicate)
    within = _groups_over(root, (0, 1, 4, 2, 3), d.dp_shard * d.cp)
    grid = root.mesh.permute(0, 4, 1, 2, 3)[mesh.local_rank("pp"), mesh.local_rank("tp")]
    return DeviceMesh.from_group(
        [across, within],
        root.device_type,
        mesh=grid.reshape(d.dp_replicate, d.dp_shard * d.cp),
        mesh_dim_names=("dp_replicate", "dp_shard_cp"),
    )


def _groups_over(mesh: DeviceMesh, order: tuple[int, ...], size: int) -> dist.ProcessGroup:
    """This rank's group among those over the last dimensions of `mesh` permuted by
    `order`, `size` ranks each (every rank creates every group)."""
    ranks = mesh.mesh.permute(*order).reshape(-1, size).tolist()
    me = dist.get_rank()
    mine = None
    for members in ranks:
        group = dist.new_group(members)
        if me in members:
            mine = group
    assert mine is not None
    return mine


def parallel_mesh(degrees: Degrees, device_type: str) -> ParallelMesh:
    """The named mesh of `degrees` over every rank (a collective: every rank must call it)."""
    d = degrees
    shape = (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp)
    return ParallelMesh(d, init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS))

