"""Apply the parallelisms of a :class:`Degrees` to a model that knows nothing of them.

The order is fixed, as in torchtitan, because each step needs what the one before left:

1. pp: cut the model's chain of layers into stages, in host memory, and keep this rank's
   (so a model bigger than one device fits once split);
2. tp: shard each unit's matrices with the model's tensor-parallel plan (DTensor), each
   slice placed on the device as it is cut;
3. place this rank's units (the stages, or the whole model) on its device, unless they
   are sharded: FSDP2 places each block as it shards it (step 4), so no rank ever holds
   more of the model than its shards and the block being sharded; a unit built on the
   meta device (`dtrain.parallel.materialize`) only gets storage there, for its part;
   then, with activation checkpointing, checkpoint the blocks, and with compile, compile
   each block in place (after tp, before dp wrappers);
4. dp: replicate (DDP, or `replicate` when composed with pp/tp) or shard (FSDP2) each unit
   over the data-parallel ranks, block by block;
5. pp: build the schedule over the wrapped stages.

Every mesh strategy (ddp, zero2, zero3, pipeline, tensor, hybrid) is this function with
other degrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtrain.config import Config
from dtrain.parallel.blocks import find_blocks, self_contained
from dtrain.parallel.compression import cast_dtype
from dtrain.parallel.data_parallel import ShardOptions, apply_ddp, apply_fsdp, apply_replicate
from dtrain.parallel.degrees import microbatches
from dtrain.parallel.device_mesh import ParallelMesh
from dtrain.parallel.expert_parallel import ExpertParallel
from dtrain.parallel.hf_pipeline import hf_feed
from dtrain.parallel.hierarchical import host_groups
from dtrain.parallel.materialize import materialize
from dtrain.parallel.pipeline import Pipeline, PipelineModel
from dtrain.parallel.preparation import Preparation
from dtrain.parallel.split import (
    Stage,
    from_pp_plan,
    joined,
    layers_of,
    layout_of,
    split_layers,
)
from dtrain.parallel.stage_checks import Tie, check_stages
from dtrain.parallel.tensor_plan import apply_tp, plan_of


@dataclass
class Parallelized:
    """What `parallelize` made of a model on this rank."""

    model: nn.Module
    """What the training loop calls (a DDP wrapper, a pipeline model, or the model)."""
    local: nn.Module
    """This rank's part under canonical names (the whole model, or its stages' layers)."""
    pipeline: Pipeline | None = None
    """The schedule over this rank's stages (pp > 1)."""


def virtual_stages(config: Config) -> int:
    """Stages per pipeline rank: --virtual-stages (default 2) when interleaved, else 1."""
    return (config.virtual_stages or 2) if config.schedule == "interleaved" else 1


def shard_options(config: Config, reshard_after_forward: bool, pp_enabled: bool) -> ShardOptions:
    """The FSDP options of `config`. Under a pipeline the gathered parameters are kept from
    forward to backward: with reshard after forward, every micro-batch would gather them
    again (torchtitan makes the same choice)."""
    return ShardOptions(
        reshard_after_forward=reshard_after_forward and not pp_enabled,
        precision=config.precision,
        cpu_offload=config.cpu_offload,
        grad_compression=config.grad_compression,
    )


def split_stages(
    model: nn.Module, pp: int, pp_rank: int, config: Config
) -> tuple[dict[int, Stage], list[Tie]]:
    """This rank's stages: s = pp_rank, pp_rank + P, ... of P x V balanced stages, checked
    (every tensor in one stage under its name in the model); and the weights tied across
    stages."""
    count = pp * virtual_stages(config)
    groups = split_layers(layers_of(model), count, config.split_points)
    stages = [Stage(group, model) for group in groups]
    ties = check_stages(model, stages, pp)
    return {s: stages[s] for s in range(pp_rank, count, pp)}, ties


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    config: Config,
    device: torch.device,
    shard: ShardOptions | None,
    preparation: Preparation,
    experts: ExpertParallel | None = None,
) -> Parallelized:
    """Apply pp, tp and dp to `model` in the fixed order above.

    `shard` None replicates the data-parallel ranks (nothing to do with one); otherwise
    they shard with these options (FSDP2 applies them even on one rank). `preparation`
    checkpoints and compiles the blocks (`dtrain.parallel.preparation`). The
    data-parallel wrappers leave the parameters of `experts` alone (split over ep ranks
    already, their gradients reduced by it).
    """
    leave = frozenset(experts.params) if experts is not None else frozenset()
    d = mesh.degrees
    plan = plan_of(model, d.tp) if d.tp_enabled else None
    # 1. pp: split where the model was built.
    stages, ties = (
        split_stages(model, d.pp, mesh.local_rank("pp"), config) if d.pp_enabled else ({}, [])
    )
    units: list[nn.Module] = list(stages.values()) or [model]
    # 2. tp, 3. device (a sharded unit is placed block by block in step 4).
    for unit in units:
        if plan is not None:
            apply_tp(unit, mesh["tp"], plan)
        if shard is None:
            materialize(unit, device)
            unit.to(device)
    local = joined([stages[s] for s in sorted(stages)], model) if stages else model
    # 3b. activation checkpointing, on the whole model's blocks (those of this rank's stages
    # included), so selective picks the same blocks under every layout.
    preparation.checkpoint(model)
    blocks = _blocks(units, config)
    for unit, inner in zip(units, blocks, strict=True):
        preparation.compile_blocks(unit, inner)
    # 4. dp.
    wrapped: nn.Module = model
    if shard is not None:
        apply_fsdp(units, blocks, mesh.dp_mesh, shard, device, leave)
    elif (d.dp_enabled or d.cp_enabled) and (stages or plan is not None):
        apply_replicate(units, blocks, mesh.dp_mesh)
    elif d.dp_enabled or d.cp_enabled:
        compression = config.grad_compression
        hosts = (
            host_groups(d.dp, config.nproc, cast_dtype(compression))
            if config.hierarchical
            else None
        )
        wrapped = apply_ddp(
            model,
            mesh.grad_group,
            device,
            hosts,
            config.find_unused_parameters,
            init_sync=False,
            grad_compression=compression,
            leave=tuple(experts.names) if experts is not None else (),
        )
    if not stages:
        return Parallelized(wrapped, local)
    # 5. pp: the schedule over the wrapped stages.
    pipeline = Pipeline(
        stages,
        d.pp * virtual_stages(config),
        config.schedule,
        microbatches(config, d.pp),
        mesh.group("pp"),
        device,
        ties,
        hf_feed(model) if from_pp_plan(model) else None,
    )
    return Parallelized(PipelineModel(local, pipeline), local, pipeline)


def _blocks(units: list[nn.Module], config: Config) -> list[list[nn.Module]]:
    """Each unit's blocks: the modules a stage holds (its layers, or the modules its wrapper
    layers use), or the repeated blocks of a whole model; a block that shares a parameter
    with modules outside it (tied weights) is left to its unit, which then holds the shared
    parameter once."""
    return [
        self_contained(
            unit,
            [unit.get_submodule(path) for path in layout_of(unit).paths]
            if isinstance(unit, Stage)
            else find_blocks(unit, config.blocks),
        )
        for unit in units
    ]
