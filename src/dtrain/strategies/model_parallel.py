"""`pipeline`, `tensor` and `hybrid`: model parallelism over a named dp x pp x tp DeviceMesh.

- tensor (``--tp T``): the model's plan shards its layers over T ranks (DTensor
  `parallelize_module`); every rank sees the whole batch.
- pipeline (``--pp P``): the model's chain of layers is cut into P stages (or P x V with
  ``--schedule interleaved``) run by a `torch.distributed.pipelining` schedule over
  ``--microbatches M``.
- hybrid: both, with ``dp = nproc / (pp x tp)`` data-parallel replicas of the whole
  arrangement, synchronised like ddp (``replicate``) or sharded like zero2/zero3
  (``fully_shard``) on the mesh's dp dimension (``--dp-mode``).

Checkpoints hold the whole model under canonical names, gathered from every stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.optim import Optimizer

from dtrain.checkpoint.format import expected_shapes
from dtrain.config import Config
from dtrain.errors import ConfigError, SetupError
from dtrain.observe.logs import LOGGER
from dtrain.parallel.degrees import Degrees, degrees_for
from dtrain.parallel.pipeline import LossFn, Pipeline, PipelineModel, check_schedule
from dtrain.parallel.split import Stage, layers_of, split_layers
from dtrain.parallel.tensor_plan import plan_of, plan_within
from dtrain.strategies.base import Strategy, register
from dtrain.strategies.blocks import find_blocks
from dtrain.strategies.dcp_state import load_full_state, whole_state
from dtrain.strategies.rebuild import group_names, rebuild
from dtrain.topology import Topology


class ModelParallel(Strategy):
    """Shared by pipeline, tensor and hybrid; the subclasses differ in which degrees they take."""

    multiprocess = True
    collective_forward = True  # with dp > 1, replicate / fully_shard act in forward

    def __init__(self, config: Config, topology: Topology) -> None:
        super().__init__(config, topology)
        self.degrees = self.layout(config, topology.world_size)
        self.mesh = self.degrees.mesh(topology.device.type)
        self.local: nn.Module | None = None
        """This rank's part of the model, under canonical names."""
        self.pipeline: Pipeline | None = None
        self._whole: dict[str, torch.Size] = {}
        self._model_class = ""
        # Checkpoint parts travel to rank 0 through host memory, never a GPU buffer.
        self._host_group = dist.new_group(backend="gloo") if topology.backend != "gloo" else None

    # -- layout ---------------------------------------------------------------------------
    @classmethod
    def layout(cls, config: Config, world_size: int) -> Degrees:
        """The degrees for `config` on `world_size` processes, checked (a ConfigError
        naming the fix otherwise)."""
        degrees = degrees_for(cls.name, world_size, config.dp, config.pp, config.tp)
        if degrees.dp == 1 and config.dp_mode != "ddp":
            raise ConfigError(
                f"--dp-mode {config.dp_mode} shards over data-parallel replicas, but this "
                f"layout has one ({degrees.describe()}); use --strategy hybrid with room "
                "for dp > 1 in --nproc, or drop --dp-mode."
            )
        if degrees.pp == 1:
            given = [
                flag
                for flag, value in (
                    ("--microbatches", config.microbatches),
                    ("--split-points", config.split_points),
                    ("--virtual-stages", config.virtual_stages),
                    ("--schedule", None if config.schedule == "1f1b" else config.schedule),
                )
                if value
            ]
            if given:
                fix = "--strategy hybrid with --pp" if cls.name == "tensor" else "--pp"
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
        check_schedule(config.schedule, cls.microbatches(config, degrees), degrees.pp)
        return degrees

    @staticmethod
    def microbatches(config: Config, degrees: Degrees) -> int:
        """Micro-batches per step: --microbatches, or max(4, stages)."""
        return config.microbatches or max(4, degrees.pp)

    @staticmethod
    def virtual_stages(config: Config) -> int:
        """Stages per pipeline rank: --virtual-stages (default 2) when interleaved, else 1."""
        return (config.virtual_stages or 2) if config.schedule == "interleaved" else 1

    @classmethod
    def batch_layout(cls, config: Config) -> tuple[int, int]:
        degrees = cls.layout(config, config.nproc * config.nnodes)
        return degrees.dp, cls.microbatches(config, degrees) if degrees.pp > 1 else 1

    @classmethod
    def check_launch(cls, config: Config) -> None:
        super().check_launch(config)
        cls.layout(config, config.nproc * config.nnodes)

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp")

    @property
    def train_group(self) -> dist.ProcessGroup | None:
        return None

    @property
    def pipelined(self) -> bool:
        return self.degrees.pp > 1

    @property
    def micro_splits(self) -> int:
        return self.microbatches(self.config, self.degrees) if self.pipelined else 1

    # -- setup ----------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        names = group_names(optimizer, model) if optimizer is not None else []
        d = self.degrees
        plan = plan_of(model, d.tp) if d.tp > 1 else None
        self._whole = expected_shapes(model)
        self._model_class = type(model).__name__
        # Split where the model was built (host memory); only this rank's stages move to
        # its device, so a model bigger than one device fits once split.
        stages = self._split(model) if d.pp > 1 else {}
        units: list[nn.Module] = list(stages.values()) or [model]
        for unit in units:
            unit.to(self.topology.device)
            if plan is not None and (part := plan_within(unit, plan)):
                parallelize_module(unit, self.mesh["tp"], part)
        self.local = (
            Stage([layer for s in sorted(stages) for layer in stages[s].layers])
            if stages
            else model
        )
        if d.dp > 1:
            self._replicate(units)
        if stages:
            self.pipeline = Pipeline(
                stages,
                d.pp * self.virtual_stages(self.config),
                self.config.schedule,
                self.microbatches(self.config, d),
                self.mesh.get_group("pp"),
                self.topology.device,
            )
            self.model = PipelineModel(self.local, self.pipeline)
            for s, stage in sorted(stages.items()):
                LOGGER.info("pipeline stage %d: %s", s, ", ".join(stage.layer_names))
        else:
            self.model = model
        if optimizer is None:
            return self.model, None
        here = {n for n, _ in self.local.named_parameters()}
        mine = [[n for n in group if n in here] for group in names]
        return self.model, rebuild(optimizer, mine, self.local)

    @property
    def model_class(self) -> str:
        return self._model_class

    def _split(self, model: nn.Module) -> dict[int, Stage]:
        """This rank's stages: s = pp_rank, pp_rank + P, ... of P x V balanced stages."""
        pp = self.degrees.pp
        count = pp * self.virtual_stages(self.config)
        groups = split_layers(layers_of(model), count, self.config.split_points)
        return {s: Stage(groups[s]) for s in range(self.mesh.get_local_rank("pp"), count, pp)}

    def _replicate(self, units: list[nn.Module]) -> None:
        """Data parallelism over the mesh's dp dimension, block by block, then each unit."""
        mode = self.config.dp_mode
        mesh = self.mesh["dp"]
        if mode == "ddp":
            wrap = partial(replicate, mesh=mesh)
        else:
            wrap = partial(fully_shard, mesh=mesh, reshard_after_forward=mode == "zero3")
        for unit in units:
            if isinstance(unit, Stage):
                inner = [unit.get_submodule(name) for name in unit.layer_names]
            else:
                inner = find_blocks(unit, self.config.blocks)
            for block in inner:
                if any(p.requires_grad for p in block.parameters()):
                    wrap(block)
            wrap(unit)

    # -- training -------------------------------------------------------------------------
    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> float:
        """The step's loss, averaged over the dp replicas: a non-finite loss on any replica
        (whose gradients the others have just averaged in) stops every one of them."""
        assert self.pipeline is not None
        loss = self.pipeline.step(inputs, targets, loss_fn)
        if self.degrees.dp == 1:
            return loss
        total = torch.tensor([loss], dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(total, group=self.dp_group)
        return total.item() / self.degrees.dp

    def backward(self, loss: torch.Tensor) -> None:
        if self.pipelined:
            raise SetupError(
                "Under a pipeline the schedule runs backward itself; train with "
                "engine.train_step(batch, loss_fn) instead of engine.backward(loss)."
            )
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the last micro-batch synchronises over dp."""
        sync = getattr(self.model, "set_requires_gradient_sync", None)
        if sync is None:
            yield
            return
        sync(False)
        try:
            yield
        finally:
            sync(True)

    def unwrap(self) -> nn.Module:
        assert self.local is not None
        return self.local

    def eval_module(self) -> nn.Module:
        assert self.model is not None
        return self.model

    def report(self) -> dict[str, object]:
        """The layout; under a pipeline, the schedule, each stage's layers and its compute
        time per step (an unbalanced split shows as one stage computing longer)."""
        out: dict[str, object] = {"layout": self.degrees.describe()}
        p = self.pipeline
        if p is None:
            return out
        per_step = 1000 / max(p.steps, 1)
        mine = {
            s: (module.layer_names, p.compute_seconds[s] * per_step)
            for s, module in p.modules.items()
        }
        everyone: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(everyone, mine)
        stages: dict[int, tuple[list[str], list[float]]] = {}
        for part in everyone:
            for s, (names, ms) in part.items():
                stages.setdefault(s, (names, []))[1].append(ms)
        order = sorted(stages)
        out["schedule"] = f"{self.config.schedule}, {p.microbatches} micro-batches"
        out["stages"] = " / ".join("+".join(stages[s][0]) for s in order)
        out["stage_compute_ms"] = " / ".join(
            f"{sum(stages[s][1]) / len(stages[s][1]):.1f}" for s in order
        )
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        assert self.local is not None
        main = self.topology.is_main
        # One rank per stage (dp 0, tp 0) keeps its stage's whole state and sends it on.
        first = self.mesh.get_local_rank("dp") == 0 and self.mesh.get_local_rank("tp") == 0
        part = whole_state(self.local, optimizer, keep=first)
        if self.degrees.pp == 1:
            return part if main else (None, None)
        senders = [int(self.mesh.mesh[p, 0, 0]) for p in range(1, self.degrees.pp)]
        if first and not main:
            dist.send_object_list([part], dst=0, group=self._host_group)
        if not main:
            return None, None
        parts = [part]
        for src in senders:
            received: list[Any] = [None]
            dist.recv_object_list(received, src=src, group=self._host_group)
            parts.append(received[0])
        return _merge(parts)

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        assert self.local is not None
        return load_full_state(
            self.local, tensors, optimizer, optimizer_state, strict, whole_model=self._whole
        )

    def close(self) -> None:
        self.pipeline = None
        self.local = None
        super().close()


def _merge(
    parts: list[tuple[dict[str, torch.Tensor], dict[str, Any] | None]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The whole model and optimizer state from the stages' parts."""
    tensors = {k: v for part, _ in parts for k, v in part.items()}
    states = [state for _, state in parts if state is not None]
    if not states:
        return tensors, None
    groups = [dict(group, params=[]) for group in states[0]["param_groups"]]
    for state in states:
        for merged, group in zip(groups, state["param_groups"], strict=True):
            merged["params"] += group["params"]
    return tensors, {
        "state": {k: v for s in states for k, v in s["state"].items()},
        "param_groups": groups,
    }


@register
class PipelineParallel(ModelParallel):
    """Layers cut into --pp stages, micro-batches pipelined through them."""

    name = "pipeline"
    order = 40


@register
class TensorParallel(ModelParallel):
    """Each layer's weight matrices split over --tp ranks (Megatron-style)."""

    name = "tensor"
    order = 41


@register
class Hybrid(ModelParallel):
    """Data x pipeline x tensor parallelism over one named DeviceMesh."""

    name = "hybrid"
    order = 42
