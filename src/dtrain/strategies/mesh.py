"""The mesh strategies: presets of data, pipeline and tensor degrees over one DeviceMesh.

ddp, zero2, zero3, hsdp, pipeline, tensor and hybrid differ only in their :class:`Degrees`
and in whether the data-parallel ranks replicate or shard (their specs, strategies/specs.py,
lay them out and check them before any process starts); :func:`parallelize` applies them
in one fixed order. This class runs every one of them (zero1 adds its optimizer): the step
seam (a pipeline schedule runs forward and backward there), gradient-sync control, and
the whole state of the model gathered for checkpoints.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from dtrain.checkpoint.format import expected_shapes
from dtrain.config import Config
from dtrain.errors import ConfigError, SetupError
from dtrain.parallel.broadcast import broadcast_model
from dtrain.parallel.clip import clip_grad_norm
from dtrain.parallel.context_parallel import SequenceCut
from dtrain.parallel.data_parallel import ShardOptions
from dtrain.parallel.degrees import microbatches
from dtrain.parallel.device_mesh import expert_mesh, parallel_mesh
from dtrain.parallel.expert_parallel import ExpertParallel
from dtrain.parallel.hooks import gradient_hooks
from dtrain.parallel.moe_balance import GlobalBalance
from dtrain.parallel.parallelize import Parallelized, parallelize, shard_options
from dtrain.parallel.pipeline import Pipeline
from dtrain.parallel.preparation import unwrap
from dtrain.parallel.split import Stage, held_names, layout_of, rename_state
from dtrain.parallel.sync_batchnorm import convert_sync_batchnorm
from dtrain.parallel.unused import UnusedWatch
from dtrain.process.logs import LOGGER
from dtrain.process.topology import Topology
from dtrain.step.batches import LossFn, Weight, forward_loss, pipeline_parts
from dtrain.strategies.base import Strategy
from dtrain.strategies.dcp_state import load_full_state, merge_parts, whole_state
from dtrain.strategies.placement import Placement
from dtrain.strategies.rebuild import group_names, repoint
from dtrain.strategies.specs import MeshSpec, StrategySpec


class MeshStrategy(Strategy):
    """A preset over :class:`Degrees`: its spec (a :class:`MeshSpec`) says which degrees
    (`layout`) and how the data-parallel ranks synchronise (`dp_mode`)."""

    def __init__(self, config: Config, topology: Topology, spec: StrategySpec) -> None:
        super().__init__(config, topology, spec)
        spec = self.spec
        assert isinstance(spec, MeshSpec)
        self.degrees = spec.layout(config, topology.world_size)
        self.dp_mode = spec.dp_mode(config)
        """ddp (replicas), zero2 or zero3 (shards): how the data-parallel ranks sync."""
        self.mesh = parallel_mesh(self.degrees, topology.device.type)
        self._expert_mesh = expert_mesh(self.mesh) if self.degrees.ep_enabled else None
        self.experts: ExpertParallel | None = None
        """The experts split over --ep ranks (set up by `wrap`)."""
        self._balance: GlobalBalance | None = None
        """A mixture of experts' balancing loss over every data-parallel rank's batch."""
        self.pipelined = self.degrees.pp_enabled
        """A pipeline's schedule runs forward and backward (a value: read every step)."""
        self.sequence = SequenceCut(self.mesh.group("cp")) if self.degrees.cp_enabled else None
        """How each batch's sequence is cut over the context-parallel ranks (--cp)."""
        self.placement = self._placement()
        self.parts: Parallelized | None = None
        self._whole: dict[str, torch.Size] = {}
        self._user: nn.Module | None = None
        self._model_class = ""
        self._unused: UnusedWatch | None = None
        """DDP without find_unused_parameters: every synchronising backward is checked."""
        self._syncing = True
        self._context = contextlib.ExitStack()
        """Process-wide switches held while this strategy trains (released at close)."""
        # Checkpoint parts travel to rank 0 through host memory, never a GPU buffer.
        self._host_group = (
            dist.new_group(backend="gloo")
            if topology.backend != "gloo" and self.degrees.pp_enabled
            else None
        )

    # -- layout ---------------------------------------------------------------------------
    @property
    def shard(self) -> ShardOptions | None:
        """The FSDP options when the data-parallel ranks shard, else None."""
        if self.dp_mode == "ddp":
            return None
        return shard_options(self.config, self.dp_mode == "zero3", self.degrees.pp_enabled)

    def _placement(self) -> Placement:
        """Where the work runs, from the degrees and the mesh."""
        d = self.degrees
        sharded = self.shard is not None
        parts = sharded or d.pp_enabled or d.tp_enabled
        return replace(
            self.placement,
            dp_size=d.dp,
            dp_rank=self.mesh.dp_rank,
            dp_group=self.mesh.dp_group,
            train_group=None,  # the stages and tensor-parallel ranks train too: every rank
            # DDP's and FSDP's waits (FSDP's also on one rank), a pipeline's stages.
            coupling=replace(
                self.placement.coupling,
                exchange_after_backward=sharded or d.dp_enabled or d.cp_enabled or d.pp_enabled,
                # Tensor-parallel ranks and pipeline stages hold copies of the loss.
                loss_group=self.mesh.grad_group,
            ),
            micro_splits=microbatches(self.config, d.pp) if d.pp_enabled else 1,
            splits_model=parts or d.ep_enabled,
            places_parts=parts,
            # Sharded parameters are gathered in forward, replicas of pipeline stages or
            # tensor-parallel layers (`replicate`) act there too, and experts get tokens.
            collective_forward=sharded
            or d.ep_enabled
            or ((d.dp_enabled or d.cp_enabled) and (d.pp_enabled or d.tp_enabled)),
            handles_precision=sharded,
            # Pipeline stages hold different layers: their gradient norms add up.
            grad_norm_groups=(self.mesh.group("pp"),) if d.pp_enabled else (),
            layout_text=d.describe(),
        )

    @property
    def _splits_balance(self) -> bool:
        """A pipeline's micro-batches, a cut sequence and micro-batches accumulated over
        several data-parallel ranks (each the union of other samples than one process's)
        split the balancing loss; over the data-parallel ranks of a whole step it is made
        the global batch's (`dtrain.parallel.moe_balance`)."""
        d = self.degrees
        accumulated = d.dp_enabled and self.config.grad_accumulation > 1
        return d.pp_enabled or d.cp_enabled or accumulated

    @property
    def pipeline(self) -> Pipeline | None:
        """The schedule over this rank's stages, under a pipeline."""
        return self.parts.pipeline if self.parts is not None else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """As every strategy does; a weight tied across pipeline stages counts once in the
        norm (its copies hold the same summed gradient) and every copy is scaled."""
        copies = self.pipeline.tied.copies() if self.pipeline is not None else []
        if not copies:
            return super().clip_grad_norm_(max_norm)
        skip = {id(p) for p in copies}
        counted = [p for p in self.unwrap().parameters() if id(p) not in skip]
        norm = clip_grad_norm(counted, max_norm, self.placement.grad_norm_groups)
        with torch.no_grad():
            for p in copies:
                if p.grad is not None:
                    p.grad.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0).to(p.grad.dtype))
        return norm

    # -- setup ----------------------------------------------------------------------------
    def wrap(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        """Start every rank from rank 0's model, then parallelise it (see
        `dtrain.parallel.parallelize`); a model passed in compiled is unwrapped first and
        compiled block by block after tensor parallelism."""
        model, preparation = unwrap(model, self.config)
        if self.sequence is not None and preparation.compile:
            raise ConfigError(
                "--cp replaces the model's attention for each step with one that gathers the "
                "sequence from the context ranks, which compiling the model would trace once "
                "and keep; pass the model to engine.setup uncompiled with --cp."
            )
        if self.shard is not None and not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"Strategy {self.name} shards parameters, but the model has none to train; "
                "use --strategy single or ddp for a model without trainable parameters."
            )
        names = group_names(optimizer, model) if optimizer is not None else []
        self._whole = expected_shapes(model)
        self._model_class = type(model).__name__
        hooks = gradient_hooks(model)
        d = self.degrees
        replicas = d.dp_enabled or d.cp_enabled
        if self.shard is not None or (replicas and (d.pp_enabled or d.tp_enabled)):
            hooks.refuse(
                self.name,
                "its data-parallel ranks reduce each gradient into a shard or replica outside "
                "autograd, where tensor hooks do not run",
            )
        broadcast_model(model, None, self.topology.device)
        if self._expert_mesh is not None:
            self.experts = ExpertParallel(
                model, self._expert_mesh, d.dp, self.topology.device, preparation.compile,
                self.handover,
            )  # fmt: skip
        if d.dp_enabled and not self._splits_balance:
            self._balance = GlobalBalance.install(model, self.mesh.dp_group)
        model = self.prepare(model)
        self._user = model
        self.parts = parallelize(
            model, self.mesh, self.config, self.topology.device, self.shard, preparation,
            self.experts,
        )  # fmt: skip
        self.model = self.parts.model
        if self.deferred is not None:  # built on the meta device: this rank's part, placed
            self.deferred.initialise(model)
        hooks.register(self.parts.local)
        if self.sequence is not None:
            self.sequence.check_model(model, self.labels, self.handover)
        if (d.tp_enabled and not d.dp_enabled) or (d.ep_enabled and self.shard is None):
            # Layers the plan does not split (under ddp --ep: all but the experts) keep
            # plain tensors beside the DTensors; a script's own clip_grad_norm_ (or any op)
            # over both would be refused by DTensor. Those tensors are the same on every
            # rank of the DTensors' mesh, which is what implicit replication assumes.
            self._context.enter_context(implicit_replication())
        find_unused = self.config.find_unused_parameters
        if isinstance(self.model, DistributedDataParallel) and not find_unused:
            self._unused = UnusedWatch(self.parts.local, self.model, self.name)
        if self.pipeline is not None:
            self.pipeline.watch_outputs(self.handover.output_watch)
            for s, stage in sorted(self.pipeline.modules.items()):
                LOGGER.info("pipeline stage %d: %s", s, ", ".join(layout_of(stage).layer_names))
        if optimizer is None:
            return self.model, None
        if self.shard is None and not (d.pp_enabled or d.tp_enabled or d.ep_enabled):
            return self.model, optimizer  # the same parameter objects: nothing to rebuild
        local = self.parts.local
        return self.model, repoint(optimizer, held_names(local, names), local)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Changes made to the model before it is parallelised: with --sync-batchnorm, its
        BatchNorm layers normalise over the data-parallel ranks' whole batch."""
        if not self.config.sync_batchnorm or not self.degrees.dp_enabled:
            return model
        return convert_sync_batchnorm(model, self.mesh.dp_group, self.topology.device)

    @property
    def model_class(self) -> str:
        return self._model_class

    # -- the step -------------------------------------------------------------------------
    def forward_backward(self, batch: Any, loss_fn: LossFn | None, scale: Weight) -> torch.Tensor:
        """Under a pipeline, the schedule runs every stage's forward and backward over
        the micro-batches (an (inputs, targets) pair with `loss_fn`, or a dict batch of a
        model that computes its own loss: `dtrain.step.batches.pipeline_parts`); every
        stage returns its replica's loss (as a data-parallel rank does: the loss reads
        average it over the replicas, and a non-finite loss on any of them is seen by
        all)."""
        if self._balance is not None:
            self._balance.weight = scale
        pipeline = self.pipeline
        cut = self.sequence
        if cut is not None:  # forward and backward (a recompute) attend over all
            part, positions = cut.cut(batch, loss_fn)
            share = cut.share(part, loss_fn, self.labels)
            if share is not None:
                scale = share * scale
            with cut.attending(positions):
                return super().forward_backward(part, loss_fn, scale)
        if pipeline is None:
            return super().forward_backward(batch, loss_fn, scale)
        inputs, targets, extras, loss_fn = pipeline_parts(batch, loss_fn, pipeline.feed)
        assert targets is not None and loss_fn is not None  # what training parts hold
        with self.autocast():
            return pipeline.step(
                inputs, targets, loss_fn, self.handover.loss_scaling, extras, weight=scale
            )

    def _forward_loss(self, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
        """With --cp, the model is told its tokens' positions."""
        if self.sequence is None:
            return super()._forward_loss(batch, loss_fn)
        return forward_loss(self.sequence.call(self.model), batch, loss_fn)[1]  # type: ignore[arg-type]

    def backward(self, loss: torch.Tensor) -> None:
        if self.pipelined:
            raise SetupError(
                "Under a pipeline the schedule runs backward itself; train with "
                "engine.train_step(batch, loss_fn) instead of engine.backward(loss)."
            )
        loss.backward()
        if self._balance is not None:
            self._balance.weight = 1.0  # a loop by hand weighs its loss itself
        if self._unused is not None and self._syncing:
            self._unused.check()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the last micro-batch synchronises over dp (and
        sums the gradients of weights tied across pipeline stages)."""
        if self.pipeline is not None:
            with self.pipeline.accumulating():
                yield
            return
        model = self.model
        sync = getattr(model, "set_requires_gradient_sync", None)
        self._syncing = False
        try:
            if isinstance(model, DistributedDataParallel):
                with model.no_sync():
                    yield
                return
            if sync is not None:
                sync(False)
            yield
        finally:
            self._syncing = True
            if sync is not None:
                sync(True)

    def unwrap(self) -> nn.Module:
        assert self.parts is not None
        return self.parts.local

    def user_model(self) -> nn.Module:
        """The model given to `setup`. Under a pipeline it holds this rank's layers, being
        trained; the layers of other ranks' stages keep their initial values."""
        assert self._user is not None
        return self._user

    def eval_module(self) -> nn.Module:
        assert self.model is not None
        return self.model if self.pipelined else self.unwrap()

    def figures(self) -> dict[str, object]:
        """The layout; under a pipeline, the schedule, each stage's layers and its compute
        time per step (an unbalanced split shows as one stage computing longer)."""
        out: dict[str, object] = {"layout": self.degrees.describe()}
        if self.pipeline is not None:
            out |= self.pipeline.figures(self.config.schedule, self.topology.world_size)
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """Whole tensors gathered one at a time by the first rank of each stage (dp 0,
        tp 0), then the stages' parts sent to rank 0."""
        local = self.unwrap()
        main = self.topology.is_main
        m = self.mesh
        first = m.dp_rank == 0 and m.local_rank("tp") == 0
        part = whole_state(local, optimizer, keep=first)
        if not self.degrees.pp_enabled:
            return part if main else (None, None)
        if part[1] is not None and isinstance(local, Stage):  # a tied weight's model name
            part = part[0], rename_state(part[1], layout_of(local).model_names)
        senders = [m.rank_at(pp=p) for p in range(1, self.degrees.pp)]
        if first and not main:
            dist.send_object_list([part], dst=0, group=self._host_group)
        if not main:
            return None, None
        parts = [part]
        for src in senders:
            received: list[Any] = [None]
            dist.recv_object_list(received, src=src, group=self._host_group)
            parts.append(received[0])
        return merge_parts(parts)

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        whole = self._whole if self.degrees.pp_enabled else None
        local = self.unwrap()
        if optimizer_state is not None and isinstance(local, Stage):
            inverse = {model_name: n for n, model_name in layout_of(local).model_names.items()}
            optimizer_state = rename_state(optimizer_state, inverse)
        return load_full_state(
            local, tensors, optimizer, optimizer_state, strict, whole_model=whole
        )

    def close(self) -> None:
        if self.sequence is not None:
            self.sequence.release()
        for held in (self.experts, self._balance):
            if held is not None:
                held.release()
        self._context.close()
        # A DDP or FSDP object alive when the process group is destroyed can abort the
        # process on gloo.
        self.parts = None
        self.model = None
        self._user = self._unused = None
        gc.collect()
