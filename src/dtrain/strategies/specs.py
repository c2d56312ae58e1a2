"""What each strategy is before any process starts, and the registry `--strategy` looks names up in.

A :class:`StrategySpec` holds what the launcher, the command line and `dtrain.init` need
to know of a strategy: its names, whether it runs one process per device, the process
layout it asks for and the options it refuses. Its runtime class (the `Strategy` that
wraps the model and runs the step) is named by dotted path and imported only by
:meth:`StrategySpec.runtime`, in the processes that train: the launcher imports none of
DDP, FSDP, DTensor, pipelining or distributed checkpoint, and this module imports no
torch.

The mesh strategies (ddp, zero1, zero2, zero3, hsdp, pipeline, tensor, hybrid) share one
runtime, `strategies/mesh.py`; their specs say which :class:`Degrees` they lay out and
whether the data-parallel ranks replicate or shard.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain.command_names import unknown_strategy
from dtrain.config import Config
from dtrain.config.rules.parallelism import pipeline_flags
from dtrain.errors import ConfigError
from dtrain.parallel.degrees import Degrees, check_schedule, degrees_for, microbatches, per_context
from dtrain.strategies.ps.roles import Roles

if TYPE_CHECKING:
    from dtrain.process.topology import Topology
    from dtrain.strategies.base import Strategy

_REGISTRY: dict[str, StrategySpec] = {}


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """A strategy as the launcher sees it; subclasses override the checks that differ."""

    name: str
    """The `--strategy` value."""
    runtime_class: str
    """The runtime class, ``module:Class`` (imported by `runtime`)."""
    order: int
    """Position in listings (`--help`, error messages): simplest strategies first."""
    aliases: tuple[str, ...] = ()
    """Other accepted names."""
    multiprocess: bool = False
    """True if the strategy runs one process per device (needs a process group); False if
    it runs in one process (`--nproc` must be 1)."""
    supports_sync_batchnorm: bool = False
    """True if --sync-batchnorm can normalise over its data-parallel processes."""
    exchange_in_step: bool = False
    """True if the optimizer step is the gradient exchange (parameter servers): the step
    breakdown counts it as communication."""

    def runtime(self) -> type[Strategy]:
        """The class a training process builds this strategy with (imported here)."""
        module, _, name = self.runtime_class.partition(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]

    def build(self, config: Config, topology: Topology) -> Strategy:
        """This strategy in a training process, for `config` on `topology`: its runtime
        class, handed this spec."""
        return self.runtime()(config, topology, self)

    def check_launch(self, config: Config) -> None:
        """Validate the process layout before any process starts (called by the launcher)."""
        if not self.multiprocess and (config.nproc != 1 or config.nnodes != 1):
            raise ConfigError(
                f"Strategy '{self.name}' runs in one process, but --nproc {config.nproc} "
                f"--nnodes {config.nnodes} were given; drop --nproc/--nnodes, or use a "
                "multi-process strategy such as --strategy ddp."
            )

    def processes_per_node(self, config: Config) -> int:
        """Processes the launcher starts on each machine (the parameter server adds its own)."""
        return config.nproc

    def batch_layout(self, config: Config) -> tuple[int, int]:
        """(data-parallel workers, equal parts each worker's batch is cut into) that
        `config` will run with, known before any process starts (the demo checks its
        batch with them)."""
        return (config.nproc * config.nnodes if self.multiprocess else 1), 1

    def role_of(self, config: Config, rank: int) -> str:
        """What global `rank` does in this strategy, for failure reports ("rank 3")."""
        return f"rank {rank}"

    def role_main(self, config: Config, rank: int) -> Callable[[], None] | None:
        """What global `rank` runs instead of the user's script, for ranks that serve
        rather than train (parameter servers); None: the rank runs the script."""
        return None

    def detect_topology(self, config: Config) -> Topology:
        """This process's topology (a strategy may place some roles on the CPU)."""
        from dtrain.process.topology import detect  # torch: only the processes that train need it

        return detect(config)

    def check_options(self, config: Config) -> None:
        """Reject options this strategy cannot honour (called by the launcher and by
        `dtrain.init`)."""
        if config.sync_batchnorm and not self.supports_sync_batchnorm:
            raise ConfigError(
                f"--sync-batchnorm has no effect under strategy '{self.name}'; drop it, or use "
                "a data-parallel strategy over processes (ddp, zero1, zero2, zero3, hsdp, "
                "hybrid), whose workers then normalise over the whole global batch."
            )
        if config.cpu_offload and not self.offloads(config):
            raise ConfigError(
                f"--cpu-offload works with --strategy zero3 only (or hybrid with --dp-mode "
                f"zero3), not '{self.name}'; drop it, or shard everything with zero3."
            )
        if config.precision == "fp16-mixed" and self.exchange_in_step:
            raise ConfigError(
                f"--precision fp16-mixed is not supported under --strategy {self.name}: the "
                "servers apply each update, so a worker cannot skip a step whose fp16 "
                "gradients overflowed (a sync round waits for every worker's gradients). Use "
                "--precision bf16-mixed or fp32, or a strategy such as ddp."
            )

    def offloads(self, config: Config) -> bool:
        """True if `config` shards the whole model state, which --cpu-offload can move."""
        return False


def tower_count(config: Config) -> int:
    """The towers `config` runs: --towers, else one per visible GPU, or 2 on the CPU."""
    from dtrain.process.topology import use_gpus  # torch: asked only when towers are laid out

    if not use_gpus(config):
        return config.towers or 2
    import torch

    visible = torch.cuda.device_count()
    count = config.towers or visible
    if count > visible:
        raise ConfigError(
            f"--towers {count} asks for more towers than the {visible} visible GPU(s); "
            "lower --towers, or pass --cpu to run the towers on the CPU."
        )
    return count


@dataclass(frozen=True, kw_only=True)
class TowersSpec(StrategySpec):
    """`towers`: one process cuts each batch over its replicas."""

    runtime_class: str = "dtrain.strategies.towers:Towers"

    def batch_layout(self, config: Config) -> tuple[int, int]:
        return 1, tower_count(config)


@dataclass(frozen=True, kw_only=True)
class LocalSGDSpec(StrategySpec):
    """`local-sgd`: replicas exchange nothing between syncs."""

    runtime_class: str = "dtrain.strategies.local_sgd:LocalSGD"
    multiprocess: bool = True

    def check_options(self, config: Config) -> None:
        if config.sync_batchnorm:
            raise ConfigError(
                "--sync-batchnorm makes every forward wait for the other replicas' batch "
                "statistics, which --strategy local-sgd's replicas do not exchange between "
                "syncs (their running statistics are averaged at each sync); drop it, or use "
                "--strategy ddp."
            )
        super().check_options(config)


@dataclass(frozen=True, kw_only=True)
class MeshSpec(StrategySpec):
    """A preset over :class:`Degrees`: every rank data-parallel, replicas (ddp) or shards
    (zero2, zero3); subclasses lay out other degrees."""

    runtime_class: str = "dtrain.strategies.mesh:MeshStrategy"
    multiprocess: bool = True
    supports_sync_batchnorm: bool = True
    reshard_after_forward: bool | None = None
    """None: data-parallel ranks hold replicas (ddp); True/False: they shard with FSDP2,
    freeing gathered parameters after forward (zero3) or keeping them (zero2)."""

    def layout(self, config: Config, world_size: int) -> Degrees:
        """The degrees for `config` on `world_size` processes, checked (a ConfigError
        naming the fix otherwise)."""
        fits = "processes, so no whole number of data-parallel ranks fits; make --nproc"
        dp, cp = per_context(world_size, config.cp, fits)
        if self.reshard_after_forward is None:
            return Degrees(dp_replicate=dp, cp=cp, ep=config.ep)
        return Degrees(dp_shard=dp, cp=cp, ep=config.ep)

    def dp_mode(self, config: Config) -> str:
        """ddp (replicas), zero2 or zero3 (shards): how the data-parallel ranks sync."""
        if self.reshard_after_forward is None:
            return "ddp"
        return "zero3" if self.reshard_after_forward else "zero2"

    def offloads(self, config: Config) -> bool:
        return self.dp_mode(config) == "zero3"

    def batch_layout(self, config: Config) -> tuple[int, int]:
        degrees = self.layout(config, config.nproc * config.nnodes)
        splits = microbatches(config, degrees.pp) if degrees.pp_enabled else 1
        return degrees.dp, splits

    def check_launch(self, config: Config) -> None:
        super().check_launch(config)
        self.layout(config, config.nproc * config.nnodes)


@dataclass(frozen=True, kw_only=True)
class HSDPSpec(MeshSpec):
    """`hsdp`: FSDP2 on a 2-D mesh, each replica's state sharded over `--shard-size` ranks
    (default: one machine's processes; with --cp, its context ranks among them) and the
    shard groups replicating one another."""

    def layout(self, config: Config, world_size: int) -> Degrees:
        size = config.shard_size or config.nproc
        if size < 2 or world_size % size:
            raise ConfigError(
                f"--strategy hsdp shards each replica over --shard-size ranks, which must be "
                f"at least 2 and divide the {world_size} processes; got {size}. Pick a "
                "divisor such as the processes of one machine (--nproc), or use --strategy "
                "ddp for plain replicas."
            )
        shard, cp = per_context(size, config.cp, "hsdp's --shard-size ranks; make it")
        return Degrees(dp_replicate=world_size // size, dp_shard=shard, cp=cp, ep=config.ep)


@dataclass(frozen=True, kw_only=True)
class ModelParallelSpec(MeshSpec):
    """`pipeline`, `tensor` and `hybrid`: they differ in which degrees they take; the
    data-parallel ranks of hybrid replicate or shard by --dp-mode."""

    def dp_mode(self, config: Config) -> str:
        return config.dp_mode

    def layout(self, config: Config, world_size: int) -> Degrees:
        degrees = degrees_for(
            self.name, world_size, config.dp, config.pp, config.tp, config.dp_mode, config.cp
        )
        if degrees.dp == 1 and config.dp_mode != "ddp":
            raise ConfigError(
                f"--dp-mode {config.dp_mode} shards over data-parallel replicas, but this "
                f"layout has one ({degrees.describe()}); use --strategy hybrid with room "
                "for dp > 1 in --nproc, or drop --dp-mode."
            )
        if not degrees.pp_enabled:
            # Config lets these through for pipeline, tensor and hybrid; whether the layout
            # has a pipeline depends on the degrees, which depend on the number of processes
            given = pipeline_flags(config)
            if given:
                fix = "--strategy hybrid with --pp" if self.name == "tensor" else "--pp"
                raise ConfigError(
                    f"{', '.join(given)} shape a pipeline, but this layout has one stage "
                    f"({degrees.describe()}); add {fix}, or drop {', '.join(given)}."
                )
            return degrees
        if config.grad_accumulation > 1:
            raise ConfigError(
                "A pipeline already accumulates gradients over its micro-batches; instead of "
                f"--grad-accumulation {config.grad_accumulation}, raise --microbatches."
            )
        check_schedule(config.schedule, microbatches(config, degrees.pp), degrees.pp)
        return degrees


NO_BACKUP_CLIPPING = (
    "Gradient clipping under --strategy ps with --backup-workers is not supported: each "
    "server fills its round with the first gradients it receives, which may be different "
    "workers' on different servers, so no global norm of one round exists. Drop "
    "--backup-workers or --clip-grad-norm."
)


@dataclass(frozen=True, kw_only=True)
class ParameterServerSpec(StrategySpec):
    """`ps`: on each machine `--nproc` workers run the script and the servers' ranks
    serve (strategies/ps/roles.py says which rank is which)."""

    runtime_class: str = "dtrain.strategies.ps.strategy:ParameterServer"
    multiprocess: bool = True
    supports_sync_batchnorm: bool = True
    exchange_in_step: bool = True  # the step commits the gradients and waits for the update

    def processes_per_node(self, config: Config) -> int:
        return Roles.of(config).per_node

    def role_of(self, config: Config, rank: int) -> str:
        return Roles.of(config).name(rank)

    def check_launch(self, config: Config) -> None:
        if config.min_nnodes is not None:
            raise ConfigError(
                "--strategy ps places its servers on the machines when the job starts, so it "
                f"cannot run elastic (--nnodes {config.min_nnodes}:{config.nnodes}); give a "
                "fixed --nnodes N."
            )
        if config.servers % config.nnodes:
            raise ConfigError(
                f"--servers {config.servers} cannot be spread evenly over --nnodes "
                f"{config.nnodes} machines (--servers counts the servers of the whole job, the "
                f"same number on each machine); use a multiple of {config.nnodes}, such as "
                f"--servers {config.nnodes * max(1, round(config.servers / config.nnodes))}."
            )

    def check_options(self, config: Config) -> None:
        super().check_options(config)
        if config.clip_grad_norm is not None and config.backup_workers:
            raise ConfigError(NO_BACKUP_CLIPPING)
        if config.sync_batchnorm and (config.ps_mode != "sync" or config.backup_workers):
            raise ConfigError(
                "--sync-batchnorm makes every worker's forward wait for the others' batch "
                "statistics, which only sync ps without backup workers does step by step; "
                "use --ps-mode sync without --backup-workers, or drop --sync-batchnorm."
            )

    def role_main(self, config: Config, rank: int) -> Callable[[], None] | None:
        """Server ranks serve (strategies/ps/serving.py) instead of running the script."""
        if not Roles.of(config).is_server(rank):
            return None
        from dtrain.strategies.ps import serving  # the server's runtime, in its process only

        return functools.partial(serving.serve, config)

    def detect_topology(self, config: Config) -> Topology:
        rank = int(os.environ.get("RANK", 0))
        if Roles.of(config).is_server(rank):
            raise ConfigError(
                f"Rank {rank} is a parameter server (--strategy ps with --nproc "
                f"{config.nproc} workers and --servers {config.servers}: the last ranks of "
                "each machine serve), so it does not run the training script; start ps jobs "
                "with `dtrain run --strategy ps --nproc W --servers K SCRIPT` (or `dtrain demo "
                "--strategy ps`), which runs the servers itself."
            )
        from dtrain.strategies.ps import serving

        return serving.topology(config, server=False)


def register(spec: StrategySpec) -> StrategySpec:
    """Make `spec` selectable by its name and aliases."""
    for key in (spec.name, *spec.aliases):
        if key in _REGISTRY:
            raise ValueError(f"Strategy name '{key}' is registered twice.")
        _REGISTRY[key] = spec
    return spec


def available() -> list[str]:
    """Names (not aliases) of the registered strategies, simplest first."""
    specs = sorted(set(_REGISTRY.values()), key=lambda spec: (spec.order, spec.name))
    return [s.name for s in specs]


def lookup(name: str) -> StrategySpec:
    """The strategy registered under `name`; a ConfigError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(unknown_strategy(name, available())) from None


# `single`: one process, one device; the reference every other strategy must match.
register(StrategySpec(name="single", runtime_class="dtrain.strategies.base:Strategy", order=0))
register(TowersSpec(name="towers", order=10))
# ddp: DistributedDataParallel, gradients averaged by bucketed ring all-reduce overlapped
# with backward (Li et al., VLDB 2020); dp_replicate = world size.
register(MeshSpec(name="ddp", order=20))
register(LocalSGDSpec(name="local-sgd", order=25))
# ZeRO (Rajbhandari et al., SC'20). Stage 1: DDP plus ZeroRedundancyOptimizer (optimizer
# state sharded). Stage 2 also shards gradients, stage 3 parameters too, with FSDP2
# `fully_shard` over dp_shard = world size: reshard_after_forward=False keeps a block's
# gathered parameters from forward to backward (stage 2), True frees them after forward
# (stage 3, 1.5x the traffic of DDP). Per rank, fp32 Adam, psi parameters: stage 1 holds
# 8 psi + 8 psi / N, stage 2 4 psi + 12 psi / N, stage 3 16 psi / N between steps.
register(MeshSpec(name="zero1", runtime_class="dtrain.strategies.zero1:Zero1", order=30))
register(ParameterServerSpec(name="ps", order=30))
register(MeshSpec(name="zero2", order=31, reshard_after_forward=False))
register(MeshSpec(name="zero3", aliases=("fsdp",), order=32, reshard_after_forward=True))
# Hybrid sharded data parallel: shards talk over the fast links inside a machine (gathers,
# reduce-scatters); across machines only the gradient all-reduce of each shard goes.
register(HSDPSpec(name="hsdp", order=33, reshard_after_forward=True))
# Model parallelism: pipeline (--pp P stages under a torch.distributed.pipelining schedule
# over --microbatches M) and tensor (--tp T, each layer's matrices split by the model's
# plan, Megatron-style) have no data-parallel ranks to normalise over; hybrid combines
# them with dp = nproc / (pp x tp) replicas or shards (--dp-mode).
register(ModelParallelSpec(name="pipeline", order=40, supports_sync_batchnorm=False))
register(ModelParallelSpec(name="tensor", order=41, supports_sync_batchnorm=False))
register(ModelParallelSpec(name="hybrid", order=42))
