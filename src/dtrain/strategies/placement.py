"""Where a strategy's work runs: the layout facts the Engine, evaluation and checkpoints read.

A runtime strategy holds one :class:`Placement` as `strategy.placement`. Its `__init__`
builds it (the base class :func:`replicas`, a subclass replaces the fields that differ),
from the config, the topology and the mesh it builds there. Two values are known only
later: under ps, the workers' process group comes from the handshake in `setup`, which
then replaces `dp_group` and `train_group`. So read the groups from `strategy.placement`
where they are used, never keep them from before `setup`; the sizes, ranks, devices and
flags are final from `__init__` and may be kept (the Engine's feeder and summary do;
fp16's loss scaling joins the training group at the end of setup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.process.topology import Topology


@dataclass(frozen=True)
class Coupling:
    """How tightly the training processes' steps and gradients are coupled."""

    lockstep: bool = False
    """True if every training process takes each step together (synchronous training), so
    reads of per-step values can be collective over the training group."""
    averages_gradients: bool = True
    """True if a step applies the mean of the data-parallel processes' gradients; False
    where each process steps on its own (local-sgd, asynchronous ps, backup workers)."""
    exchange_after_backward: bool = False
    """True if a backward goes on after autograd's pass to exchange or combine the
    gradients (DDP's and FSDP's waits for their last buckets, towers' sums, a pipeline's
    stages): the step breakdown then marks the pass's end and counts the rest as
    communication; without one, backward ends with the pass and nothing is watched."""
    loss_group: dist.ProcessGroup | None = None
    """The processes whose losses differ (each computed other samples), over which a
    loss read in lockstep is collective; None: the training group."""


@dataclass(frozen=True)
class Placement:
    """How the processes split the data and the model, as seen from this process."""

    input_device: torch.device
    """Where the Engine puts each batch before calling the model."""
    devices: tuple[torch.device, ...] = ()
    """The devices this process computes on: its own, or each tower's."""

    # -- the data ------------------------------------------------------------------------
    dp_size: int = 1
    """Number of data-parallel processes (each reads a different share of the data)."""
    dp_rank: int = 0
    """This process's index among the data-parallel processes."""
    dp_group: dist.ProcessGroup | None = None
    """The process group of the data-parallel processes (None: the default group)."""
    train_group: dist.ProcessGroup | None = None
    """Every process that runs the training loop (barriers, per-rank records): the
    data-parallel processes unless model parallelism adds more (None: the default group)."""
    coupling: Coupling = Coupling()
    """How the processes' steps and gradients come together."""
    micro_splits: int = 1
    """How many equal parts one process's batch is further split into (towers, pipeline
    micro-batches)."""

    # -- the model -----------------------------------------------------------------------
    splits_model: bool = False
    """True if the optimizer each rank steps holds only part of the model or of its state
    (sharded, pipelined, tensor-parallel, parameter servers)."""
    places_parts: bool = False
    """True if `setup` places only this rank's part of the model on its device (shards,
    stages, slices), so that a model built on the meta device is materialised and
    initialised there part by part (the strategy's `deferred`); False: `setup`
    materialises it whole on the device before `wrap`."""
    collective_forward: bool = False
    """True if the model's forward is a collective over the data-parallel ranks (sharded
    parameters gathered), so every one of them must run as many forwards."""
    handles_precision: bool = False
    """True if the strategy's wrappers apply --precision themselves (FSDP's mixed-precision
    policy); otherwise the strategy's `autocast` does."""
    grad_norm_groups: tuple[dist.ProcessGroup, ...] = ()
    """Groups whose ranks hold gradients of different parameters, not expressed as DTensor
    placements (pipeline stages): the gradient norm's squares are summed over them."""
    layout_text: str | None = None
    """How the processes split the work (``dp2 x pp1 x tp1``), where it says more than the
    strategy's name."""


def replicas(topology: Topology, multiprocess: bool) -> Placement:
    """A whole replica of the model in each process on its device, every process one
    data-parallel worker taking each step together (one worker if not `multiprocess`)."""
    return Placement(
        input_device=topology.device,
        devices=(topology.device,),
        dp_size=topology.world_size if multiprocess else 1,
        dp_rank=topology.rank if multiprocess else 0,
        coupling=Coupling(lockstep=multiprocess),
    )
