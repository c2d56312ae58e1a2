"""The degrees of data, context, pipeline and tensor parallelism, and the pipeline's shape:
arithmetic.

One :class:`Degrees` says how many ways the job is split along each dimension: data
parallel as replicas (ddp, ``dp_replicate``) times shards (zero2/zero3, ``dp_shard``),
context parallel (``cp``: each sample's sequence cut over ranks), pipeline stages (``pp``)
and tensor shards (``tp``); expert parallel groups (``ep``) are carved out of the
data-parallel ranks. Every mesh strategy is a preset over
it; it is validated once (the product is the world size), before any process starts (the
launcher checks a layout with it, so this module imports no torch); `parallel/device_mesh.py`
builds the named DeviceMesh over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import Config
from dtrain.errors import ConfigError


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
    cp: int = 1
    """Context-parallel ranks, each holding a slice of every sample's sequence."""
    ep: int = 1
    """Expert-parallel ranks: groups of this many data-parallel ranks split each
    mixture-of-experts layer's experts (not a factor of the world size: they are dp ranks)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"The {name} degree must be at least 1, got {getattr(self, name)}."
                )
        if self.dp % self.ep:
            raise ConfigError(
                f"--ep {self.ep} groups the {self.dp} data-parallel ranks to split the "
                f"experts, but does not divide them; use an --ep that divides {self.dp}."
            )

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: each reads a different share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.cp * self.pp * self.tp

    @property
    def dp_enabled(self) -> bool:
        """True with more than one data-parallel rank."""
        return self.dp > 1

    @property
    def pp_enabled(self) -> bool:
        """True with more than one pipeline stage."""
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        """True with more than one tensor-parallel rank."""
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        """True with more than one context-parallel rank."""
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        """True with the experts split over more than one rank."""
        return self.ep > 1

    def describe(self) -> str:
        """``dp2 x pp2 x tp1`` (with ``(replicate 2 x shard 2)`` when both are used, and
        ``x cp2`` after dp with context parallelism)."""
        dp = f"dp{self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp += f" (replicate {self.dp_replicate} x shard {self.dp_shard})"
        cp = f" x cp{self.cp}" if self.cp_enabled else ""
        ep = f" (experts over ep{self.ep})" if self.ep_enabled else ""
        return f"{dp}{cp} x pp{self.pp} x tp{self.tp}{ep}"


def degrees_for(
    strategy: str,
    nproc: int,
    dp: int | None,
    pp: int | None,
    tp: int | None,
    dp_mode: str = "ddp",
    cp: int = 1,
) -> Degrees:
    """The degrees `strategy` runs with on `nproc` processes, or a ConfigError that says why not.

    `pipeline` is pp only and `tensor` tp only (their degree defaults to --nproc, divided by
    `cp` context ranks for tensor); `hybrid`
    combines them, with dp defaulting to what is left of --nproc, replicated for
    ``dp_mode`` ddp and sharded for zero2/zero3. A degree given is at least 1 (Config
    refuses less).
    """
    if strategy == "pipeline":
        _only(strategy, "--pp", {"--dp": dp, "--tp": tp})
        degrees = Degrees(pp=pp or nproc)
    elif strategy == "tensor":
        _only(strategy, "--tp", {"--dp": dp, "--pp": pp})
        degrees = Degrees(tp=tp or max(1, nproc // cp), cp=cp)
    else:
        pp, tp = pp or 1, tp or 1
        if pp > 1 and cp > 1:
            raise ConfigError(
                f"--cp {cp} cuts each sample's sequence, which a pipeline's stages cannot "
                "pass on cut; drop --pp or --cp."
            )
        if dp is None:
            if nproc % (pp * tp * cp):
                raise ConfigError(
                    f"--pp {pp} x --tp {tp} x --cp {cp} = {pp * tp * cp} does not divide "
                    f"--nproc {nproc}, so no whole number of data-parallel replicas fits; "
                    "make --nproc a multiple of pp x tp x cp."
                )
            dp = nproc // (pp * tp * cp)
        if dp_mode == "ddp" and dp > 1 and tp > 1 and cp > 1:
            raise ConfigError(
                f"--cp {cp} beside --tp {tp} and {dp} data-parallel replicas averages the "
                "gradients over the replicas and the context ranks together, which the "
                "replicas of --dp-mode ddp cannot; use --dp-mode zero2 or zero3."
            )
        if dp_mode == "ddp":
            degrees = Degrees(dp_replicate=dp, pp=pp, tp=tp, cp=cp)
        else:
            degrees = Degrees(dp_shard=dp, pp=pp, tp=tp, cp=cp)
    if degrees.world_size != nproc:
        raise ConfigError(
            f"--strategy {strategy} lays out {degrees.describe()} = {degrees.world_size} "
            f"processes, but --nproc is {nproc}; the product of the degrees must equal "
            f"--nproc. Use --nproc {degrees.world_size}, or change the degrees."
        )
    return degrees


def per_context(ranks: int, cp: int, what: str) -> tuple[int, int]:
    """(`ranks` // `cp`, `cp`): the groups of `cp` context ranks in `ranks`; a ConfigError
    when `cp` does not divide them (`what`: those ranks, and the start of the fix)."""
    if ranks % cp:
        raise ConfigError(
            f"--cp {cp} does not divide the {ranks} {what} a multiple of {cp}, or change --cp."
        )
    return ranks // cp, cp


def _only(strategy: str, allowed: str, others: dict[str, int | None]) -> None:
    given = [flag for flag, value in others.items() if value not in (None, 1)]
    if given:
        raise ConfigError(
            f"--strategy {strategy} splits the model along {allowed} only, but "
            f"{', '.join(given)} was given; use --strategy hybrid to combine data, pipeline "
            "and tensor parallelism."
        )


def microbatches(config: Config, pp: int) -> int:
    """Micro-batches per pipeline step: --microbatches, or max(4, stages)."""
    return config.microbatches or max(4, pp)


def check_schedule(schedule: str, microbatches: int, pp: int) -> None:
    """Refuse micro-batch counts the schedule cannot run, before any process starts."""
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(
            f"--schedule 1f1b needs at least one micro-batch per stage (--microbatches >= "
            f"--pp {pp}), got {microbatches}; raise --microbatches, or use --schedule gpipe "
            "(which runs any count, 1 being the naive split)."
        )
    if schedule == "interleaved":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"--schedule interleaved runs --microbatches {microbatches} in "
                f"{rounds} equal rounds (max(1, M // --pp {pp})), which they do not divide "
                f"into; use a multiple of {pp}."
            )
