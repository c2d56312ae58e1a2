"""The degrees of data, pipeline and tensor parallelism, and the named DeviceMesh over them.

Ranks are laid out pp-major, tp-minor (as torchtitan does): the tp ranks of a stage are
neighbours (same machine, fastest links), the dp replicas of a stage come next, and the
pipeline stages are furthest apart (they exchange only activations).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.errors import ConfigError

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Degrees:
    """How many ways the job is split along each dimension; dp * pp * tp = processes."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.pp * self.tp

    def describe(self) -> str:
        """``dp2 x pp2 x tp1``."""
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}"

    def mesh(self, device_type: str) -> DeviceMesh:
        """The named 3-D mesh ("pp", "dp", "tp") over every rank (a collective)."""
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)


def degrees_for(
    strategy: str, nproc: int, dp: int | None, pp: int | None, tp: int | None
) -> Degrees:
    """The degrees `strategy` runs with on `nproc` processes, or a ConfigError that says why not.

    `pipeline` is pp only and `tensor` tp only (their degree defaults to --nproc); `hybrid`
    combines them, with dp defaulting to what is left of --nproc.
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
        degrees = Degrees(dp=dp, pp=pp, tp=tp)
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
