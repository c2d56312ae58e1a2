"""What every strategy does in a training process: the runtime protocol, and `single`.

A strategy owns how the model and optimizer are wrapped, how gradients are synchronised
and which module holds the canonical (unwrapped) parameters. The Engine owns the loop
mechanics that are the same for all of them (micro-batching, loss checks, stepping).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel import materialize
from dtrain.parallel.build_record import BuildRecord
from dtrain.parallel.clip import clip_grad_norm
from dtrain.parallel.materialize import DeferredInit
from dtrain.parallel.moe_balance import refuse_local_balance
from dtrain.parallel.preparation import unwrap
from dtrain.parallel.sync_batchnorm import warn_unsynced_batchnorm
from dtrain.process.topology import Topology
from dtrain.step.batches import (
    LabelCounter,
    LossFn,
    Weight,
    forward_loss,
    label_counter,
    share_weights,
    weigh,
)
from dtrain.step.precision import LossScaling, compute_dtype
from dtrain.strategies.checkpoint_state import CheckpointState
from dtrain.strategies.placement import replicas

if TYPE_CHECKING:
    from dtrain.strategies.specs import StrategySpec


def _nothing() -> None:
    """Told nothing: a strategy set up without an Engine's observers."""


def _unwatched(tensor: torch.Tensor) -> torch.Tensor:
    """Watched by no one: a strategy set up without an Engine's observers."""
    return tensor


@dataclass(frozen=True)
class Handover:
    """What the Engine hands its strategy once, with `Strategy.setup`.

    Args:
        forward_done: tells the Engine's observers that a micro-batch's forward computed
            the loss it is given (weighted and scaled, about to be back-propagated); returns
            the tensor to back-propagate instead, whose backward they watch
            (`Observers.on_forward_end`).
        output_watch: has the Engine's observers watch the backward through a tensor the
            strategy's own schedule back-propagates (a pipeline stage's output:
            `Observers.watch_output`).
        loss_scaling: fp16-mixed's loss scale, applied to each loss; None otherwise.
        empty_build: what the model's build did inside `engine.init_empty()` (the model is
            on the meta device), replayed to initialise it; None otherwise.
        pretrained: the state-dict names of the tensors a Hugging Face folder sets right
            after setup (``engine.setup(pretrained=...)``): the replay draws none of them.
        collective_started, collective_ended: tell the Engine's observers that a
            collective inside a forward or backward starts, or ended: its time is
            communication (`Observers.on_collective_start`).
    """

    forward_done: Callable[[torch.Tensor], torch.Tensor] = _unwatched
    loss_scaling: LossScaling | None = None
    empty_build: BuildRecord | None = None
    pretrained: frozenset[str] = frozenset()
    collective_started: Callable[[], None] = _nothing
    collective_ended: Callable[[], None] = _nothing
    output_watch: Callable[[torch.Tensor], object] = _unwatched


class Strategy(CheckpointState):
    """What a strategy does in a training process: wrap the model, run a step's forward and
    backward, synchronise gradients; its state for checkpoints is the part it inherits
    (:class:`CheckpointState`); where the work runs is its `placement`
    (strategies/placement.py). This base class is `single` (one device per process, no
    wrapping); subclasses override the methods that differ and, in `__init__`, replace
    the fields of `placement` that differ.

    What is known before any process starts (names, the process layout, the options
    refused) is the strategy's spec, `self.spec` (strategies/specs.py), which builds it
    (`StrategySpec.build`).
    """

    def __init__(self, config: Config, topology: Topology, spec: StrategySpec) -> None:
        self.config = config
        self.topology = topology
        self.spec = spec
        self.model: nn.Module | None = None
        self.handover = Handover()
        """What the Engine handed over with `setup`."""
        self.deferred: DeferredInit | None = None
        """How `wrap` initialises this rank's part of a model built on the meta device."""
        self._compute_dtype = compute_dtype(config.precision)
        self.placement = replicas(topology, self.spec.multiprocess)
        """Where the work runs (strategies/placement.py); a subclass's `__init__` replaces
        the fields that differ."""
        self.labels: LabelCounter | None = None
        """How the model's own loss counts a batch's labels (a Hugging Face model's), so
        that shares of a batch are weighted by their labels (step/batches.py)."""

    @property
    def name(self) -> str:
        """The `--strategy` name (an alias's strategy: zero3 for fsdp)."""
        return self.spec.name

    def setup(
        self, model: nn.Module, optimizer: Optimizer | None, handover: Handover
    ) -> tuple[nn.Module, Optimizer | None]:
        """Keep what the Engine hands over, then `wrap` the model (the Engine calls this
        once; a strategy overrides `wrap`, so that none can lose the handover).

        A model built on the meta device is materialised and initialised whole here,
        unless this strategy places only each rank's part (`placement.places_parts`): then
        `self.deferred` says how `wrap` initialises that part once placed."""
        self.handover = handover
        self.deferred = materialize.prepare(
            model,
            handover.empty_build,
            self.placement.places_parts,
            self.topology.device,
            handover.pretrained,
        )
        self.labels = label_counter(model)
        if self._splits_balance:
            refuse_local_balance(model, self.name)
        self._note_unsynced_batchnorm(model)
        return self.wrap(model, optimizer)

    @property
    def _splits_balance(self) -> bool:
        """True if a mixture of experts' load-balancing loss, which the model computes
        over the batch it is given, would be computed over parts of the step's batch
        (data-parallel replicas, towers, micro-batches) and not made whole again."""
        return self.placement.dp_size > 1 or self.placement.micro_splits > 1

    def _note_unsynced_batchnorm(self, model: nn.Module) -> None:
        """Warn, naming the layers, where BatchNorm would normalise each process's share of
        the batch although --sync-batchnorm could make it normalise the whole batch."""
        if self.config.sync_batchnorm or self.placement.dp_size == 1:
            return
        try:
            self.spec.check_options(replace(self.config, sync_batchnorm=True))
        except ConfigError:
            return  # the flag is refused here (towers, local-sgd, ps async): nothing to offer
        warn_unsynced_batchnorm(
            model,
            self.placement.dp_size,
            "process's",
            "Add --sync-batchnorm (dtrain.init(sync_batchnorm=True)) to normalise over the "
            "whole global batch, as one device does.",
        )

    def wrap(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        """Place and wrap `model`; return (module the loop calls, optimizer the loop steps).

        `optimizer` was built on ``model.parameters()``; a strategy may return another
        optimizer (a sharded one, or one rebuilt on new parameters) in its place. A model
        passed in compiled is unwrapped and, as with --compile, compiled block by block.
        """
        model, preparation = unwrap(model, self.config)
        self.model = model.to(self.topology.device)
        preparation.finish(self.model)
        return self.model, optimizer

    def unwrap(self) -> nn.Module:
        """The user's module, whose state_dict has canonical parameter names."""
        assert self.model is not None
        return self.model

    def user_model(self) -> nn.Module:
        """The user's model object (what `engine.module` returns): the module given to
        `setup`, its methods (``get_num_params()``, ...) callable."""
        return self.unwrap()

    def refresh(self) -> None:
        """Bring this process's parameters up to date before they are read (evaluation,
        checkpoints); a collective where the strategy needs one. Default: nothing to do."""

    def eval_module(self) -> nn.Module:
        """The module to evaluate with (no gradient synchronisation, any batch count)."""
        return self.unwrap()

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 or fp16 autocast for --precision bf16-mixed or fp16-mixed, unless the
        strategy's wrappers apply the precision themselves (FSDP's mixed-precision policy)."""
        dtype = self._compute_dtype
        if dtype is None or self.placement.handles_precision:
            return contextlib.nullcontext()
        return torch.autocast(self.topology.device.type, dtype=dtype)

    def share_weights(self, shares: list[Any], loss_fn: LossFn | None) -> list[Weight]:
        """The weight of each of a step's micro-batches in this process, as
        `dtrain.step.batches.share_weights` says: by samples, or by labels for a
        model whose own loss averages over them, counted over every data-parallel process
        where the step averages their gradients."""
        placement = self.placement
        replicas = placement.dp_size if placement.coupling.averages_gradients else 1
        return share_weights(shares, loss_fn, self.labels, placement.dp_group, replicas)

    def forward_backward(self, batch: Any, loss_fn: LossFn | None, scale: Weight) -> torch.Tensor:
        """The step seam: forward and backward of one micro-batch of one process.

        `batch` is on `placement.input_device`, in any of the shapes `dtrain.step.batches`
        describes (an ``(inputs, targets)`` pair, a dict, or a nesting of tensors); its mean
        loss is back-propagated times `scale` (its weight in the step, `share_weights`).
        Returns that weighted loss, detached, on the device: never read back here, so the
        step does not wait for the device. Every strategy's work for a step happens here or
        in the optimizer's step.
        """
        with self.autocast():
            loss = self._forward_loss(batch, loss_fn)
        scaling = self.handover.loss_scaling
        weighted = weigh(loss, scale)
        root = weighted if scaling is None else scaling.scale(weighted)
        self.backward(self.handover.forward_done(root))
        return weighted.detach()

    def _forward_loss(self, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
        """The forward of one micro-batch: its mean loss (`dtrain.step.batches`)."""
        return forward_loss(self.model, batch, loss_fn)[1]  # type: ignore[arg-type]

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate `loss` and make the gradients ready for the optimizer."""
        loss.backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients the optimizer is about to apply to the global norm
        `max_norm`; return the norm before clipping (see `dtrain.parallel.clip`)."""
        groups = self.placement.grad_norm_groups
        return clip_grad_norm(self.unwrap().parameters(), max_norm, groups)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, skipping synchronisation, inside the block."""
        yield

    def figures(self) -> dict[str, object]:
        """Strategy-specific measurements for the run's metrics (call on every rank; the
        main rank gets them)."""
        return {}

    def close(self) -> None:
        """Release wrappers before the process group is destroyed."""
        self.model = None
