"""The Engine users hold: setup, dataloader, train_step, evaluate, save/load.

The training loop is written once against the Engine; the strategy behind it decides how
the model is wrapped and how gradients are synchronised. Loop mechanics that every
strategy shares (moving batches, micro-batching, loss checks, stepping, counting) live
here, so strategies only say what differs. What the Engine answers without training
(`dtrain.engine.job_view`), its data methods (`dtrain.engine.data_side`) and its checkpoint methods
(`dtrain.engine.checkpoint_side`) are its base classes, each in its own module; what it is built
from and how it is taken apart, `dtrain.engine.assembly`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.hf_folder import pretrained_names
from dtrain.config import Config
from dtrain.engine.assembly import banner, loss_scaling, release, watchers
from dtrain.engine.checkpoint_side import CheckpointSide
from dtrain.engine.data_side import DataSide, Feeder
from dtrain.engine.evaluation import evaluate, shortfall
from dtrain.engine.job_view import JobView
from dtrain.errors import CheckpointError, ConfigError, SetupError
from dtrain.observe.events import End, Run
from dtrain.observe.progress import Throughput
from dtrain.parallel import build_record
from dtrain.parallel.build_record import BuildRecord
from dtrain.process.logs import LOGGER
from dtrain.process.teardown import close_at_exit, forget
from dtrain.process.topology import Topology
from dtrain.step.batches import LossFn, batch_size, split, to_device
from dtrain.step.optimizers import check_split, train_step_refusal
from dtrain.step.position import Position
from dtrain.strategies.base import Handover, Strategy


class Engine(JobView, DataSide, CheckpointSide):
    """One process's handle on the job. Build it with :func:`dtrain.init`."""

    def __init__(self, config: Config, topology: Topology, strategy: Strategy) -> None:
        self.config = config
        self.topology = topology
        self.strategy = strategy
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.position = Position()
        self.throughput = Throughput()
        self._closed = False
        close_at_exit(self)
        self.loss_scaling = loss_scaling(config, strategy)
        """fp16-mixed's loss scale and its count of skipped steps (None otherwise)."""
        p, position, throughput = strategy.placement, self.position, self.throughput
        self._feeder = Feeder(
            p.dp_size, p.dp_rank, p.input_device, position, throughput, self.print, self.is_main
        )
        watched = watchers(config, topology, strategy, position, throughput, self.loss_scaling)
        self.checkpoints = watched.checkpoints
        self.report = watched.report
        """The metric logs (--logger) and the results JSON (--metrics-json)."""
        self.timing = watched.timing
        """Where each step's time goes (the breakdown, diagnosis and trace)."""
        self.observers = watched.observers
        """What watches the steps, told each step event in this order (see
        `dtrain.observe.events`); append an `Observer` to watch them too."""
        self._loss, self.memory_watch = watched.loss, watched.memory
        self._step_refusal: SetupError | None = None
        """Why train_step cannot step the optimizer (one that needs a closure), if so."""
        self._empty_build: BuildRecord | None = None
        """What the model's build did inside the last `init_empty` block (till setup)."""

    @property
    def module(self) -> nn.Module:
        """The user's model object, unwrapped (canonical parameter names, its own methods
        callable); under a pipeline only this rank's layers in it are trained."""
        self._require_setup("engine.module")
        return self.strategy.user_model()

    # -- setup ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def init_empty(self) -> Iterator[None]:
        """Build the model inside this block without memory: on torch's meta device, every
        shape and no values. `setup` then gives storage on the device only to the part this
        rank holds (its shards, pipeline stages or tensor-parallel slices; the whole model
        under the strategies that hold whole copies) and gives it exactly the values, bit
        for bit, that building the whole model on the CPU draws from the random state at
        this block's start (rank 0's), or refuses the model by name before training.

        The block records how the build initialises the tensors and setup replays it in the
        same order: each ``reset_parameters()`` (torch's layers), each ``init_weights()``
        (a constructor ending with it, Hugging Face's ``post_init``), each ``torch.nn.init``
        call a constructor makes itself (torchvision's ResNet). A model whose constructor
        does not call its ``init_weights()`` (torchtitan's) has it called once after, as its
        trainer does. Refused at setup, naming the module and what to do: a tensor nothing
        replayable sets (a value computed in a constructor), a write through a view or a
        random tensor made in a constructor, random numbers drawn on the CPU or a seed set
        once the build's initialisation began, a module changed after its init method ran
        (a head replaced), an init method that rebinds its own argument (see
        `dtrain.parallel.materialize`); a seed set in the block before building is
        honoured. Build the optimizer from
        ``model.parameters()`` as usual: setup keeps it pointing at what trains."""
        with build_record.recording() as record:
            yield
        self._empty_build = record

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        pretrained: str | Path | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Place and wrap `model` for the strategy; return (model to call, optimizer).

        Build `optimizer` from ``model.parameters()`` before calling this. A model built
        inside `init_empty` is materialised and initialised here. `pretrained`: a Hugging
        Face model folder loaded once the model is placed (``engine.load(folder)``); a
        model built inside `init_empty` then draws no random values for what the folder
        holds, and computes only the rest (buffers no checkpoint stores, such as rotary
        tables).
        """
        if self.model is not None:
            raise SetupError("engine.setup was called twice; call it once per Engine.")
        if optimizer is not None:
            check_split(optimizer, self.strategy.name, self.strategy.placement.splits_model)
            self._step_refusal = train_step_refusal(optimizer)
        kind = type(optimizer).__name__  # the user's class, whatever the strategy returns
        record, self._empty_build = self._empty_build, None
        folder = Path(pretrained) if pretrained is not None else None
        loaded = pretrained_names(folder) if folder is not None and record else frozenset()
        o = self.observers
        timing = (o.on_collective_start, o.on_collective_end)  # collectives in a forward
        handover = Handover(
            o.on_forward_end, self.loss_scaling, record, loaded, *timing, o.watch_output
        )
        self.model, optimizer = self.strategy.setup(model, optimizer, handover)
        self.optimizer = optimizer
        if self.loss_scaling is not None:  # the group, read once setup made it
            self.loss_scaling.join(self.strategy.placement.train_group)
        if optimizer is not None:
            # Counts the step, then tells the observers (the dispatcher hooks its start).
            optimizer.register_step_post_hook(self._count_step)
            if self.loss_scaling is not None:
                self.loss_scaling.wrap_step(optimizer, self._skipped_step)
        placement = self.strategy.placement
        module = self.strategy.unwrap()
        coupling = placement.coupling
        self.observers.on_setup(
            Run(
                module,
                self.model,
                optimizer,
                placement.train_group,
                coupling.lockstep,
                coupling.loss_group,
            )
        )
        if folder is not None:
            self.load(folder)
        said = banner(self.strategy, self.world_size, optimizer, kind)
        LOGGER.info(said)
        self.print(said)
        return self.model, optimizer

    def _count_step(self, *_: Any) -> None:
        # The first observer counts it in the position (`TrainedSamples`).
        self.observers.on_optimizer_step(self.position.step + 1)

    def _skipped_step(self, hooks_ran: bool) -> None:
        """An fp16-mixed step skipped on every rank (a gradient overflowed): it counts as
        a step (its batch was consumed); the first one is said on the main rank."""
        if not hooks_ran:
            self._count_step()
        assert self.loss_scaling is not None
        message = (
            f"step {self.step} skipped: fp16 gradients overflowed; loss scale lowered to "
            f"{self.loss_scaling.scale_value:g}"
        )
        LOGGER.info(message)
        if self.loss_scaling.skipped == 1:
            self.print(f"dtrain: {message} (later skips are counted at the end).")

    def _require_setup(self, what: str) -> None:
        if self.model is None:
            raise SetupError(
                f"{what} was used before engine.setup(model, optimizer); call setup first."
            )

    # -- training -------------------------------------------------------------------------
    def to_device(self, batch: Any) -> Any:
        """Move a batch (tensors, or any nesting of tuples, lists and dicts of them) to
        `engine.device`."""
        return to_device(batch, self.strategy.placement.input_device)

    def train_step(self, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Forward, backward, gradient sync, clipping and optimizer step on one batch.

        `batch` is an ``(inputs, targets)`` pair (the loss is ``loss_fn(model(inputs),
        targets)``), a dict (``model(**batch)``; the loss is ``loss_fn(output, batch)``, or
        with ``loss_fn=None`` the output's own ``.loss``, as Hugging Face models return it
        given labels), or any nesting of tensors (``model(batch)``); see `dtrain.step.batches`.
        The loss must be the mean over the batch's samples, or a Hugging Face model's own
        loss, the mean over the labels that are not -100: shares of the batch are then
        weighted by their labels, as one device weighs them (`dtrain.step.batches`).
        With ``grad_accumulation=k`` the batch is cut along its first dimension into k
        micro-batches whose gradients are accumulated locally and synchronised once. With
        ``clip_grad_norm`` the global gradient norm is clipped before the update. Returns
        this process's loss, detached, on the device (``.item()`` waits for it): the mean
        over the data-parallel processes (with --cp, and their context ranks) of what they
        return is the global batch's mean loss (where labels weigh, each returns its
        labels' share of that mean).
        """
        self._require_setup("engine.train_step")
        if self.optimizer is None:
            raise SetupError("engine.train_step needs an optimizer; pass it to engine.setup.")
        if self._step_refusal is not None:
            raise self._step_refusal
        step = self.position.step + 1
        loss = None
        self.observers.on_step_start(step)
        try:
            loss = self._step(step, batch, loss_fn, self.optimizer)
            return loss
        finally:
            self.observers.on_step_end(step, loss)  # also when the step raised (loss None)

    def _step(
        self, step: int, batch: Any, loss_fn: LossFn | None, optimizer: torch.optim.Optimizer
    ) -> torch.Tensor:
        batch = self.to_device(batch)
        k = self.config.grad_accumulation
        total = batch_size(batch)
        if total < k:
            raise SetupError(
                f"A batch of {total} sample(s) cannot be cut into --grad-accumulation {k} "
                "micro-batches; use a larger batch or fewer micro-batches."
            )
        if self.loss_scaling is not None:
            self.loss_scaling.backward()
        parts = split(batch, k) if k > 1 else [batch]
        weights = self.strategy.share_weights(parts, loss_fn)
        mean: torch.Tensor | int = 0
        for i, (part, weight) in enumerate(zip(parts, weights, strict=True)):
            sync = contextlib.nullcontext() if i == k - 1 else self.strategy.no_sync()
            self.observers.on_micro_start(total if k == 1 else batch_size(part))
            with sync:
                loss = self.strategy.forward_backward(part, loss_fn, weight)
            self.observers.on_micro_end()
            mean = loss if k == 1 else mean + loss
        assert isinstance(mean, torch.Tensor)
        self.observers.on_gradients(step, mean)
        if self.config.clip_grad_norm is not None:
            self.clip_grad_norm_(self.config.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return mean

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most `max_norm`; return
        the norm before clipping (a 0-d tensor on the device, not read back).

        The norm is that of the whole model's gradient, as `single` would compute it, under
        every strategy (sharded and tensor-parallel gradients, pipeline stages, towers;
        NaN under sync ps, where the servers clip the round's mean and keep its norm).
        Call it between backward and ``optimizer.step()`` in a hand-written loop (on every
        rank: it is a collective); `train_step` calls it itself with ``clip_grad_norm``.
        Under fp16-mixed it first divides the gradients by the loss scale
        (`unscale_gradients`).
        """
        self._require_setup("engine.clip_grad_norm_")
        if not max_norm > 0:
            raise ConfigError(
                f"The gradient-norm bound must be positive, got {max_norm}; use a value such "
                "as 1.0, or do not clip."
            )
        self.unscale_gradients()
        norm = self.strategy.clip_grad_norm_(max_norm)
        self.observers.on_grad_norm(norm)
        return norm

    def unscale_gradients(self) -> None:
        """Under --precision fp16-mixed, divide this step's gradients by the loss scale
        now, so that a hand-written loop can read or clip them itself (as
        ``scaler.unscale_(optimizer)`` in torch's recipe); once per step, after its last
        backward, on every rank (the overflow check is agreed over the job). The
        optimizer's step and `clip_grad_norm_` do it themselves; a no-op under other
        precisions."""
        self._require_setup("engine.unscale_gradients")
        if self.loss_scaling is not None and self.optimizer is not None:
            self.loss_scaling.unscale_(self.optimizer)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The gradient norm before the last clipping (on the device), for the logs."""
        return self._loss.grad_norm

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add the script's own `metrics` (name -> number) to the metric logs (--logger) at
        `step` (default: the current optimizer step); only the main rank writes."""
        self.report.log(metrics, self.step if step is None else step)

    def check_loss(self) -> float | None:
        """The last loss, read back now (under synchronous strategies a collective over the
        data-parallel ranks: call it on every rank); raises NonFiniteLossError if a loss
        since the last read was NaN or infinite. The Engine calls it every ``log_every``
        steps and before checkpoints."""
        self._require_setup("engine.check_loss")
        return self._loss.read()

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 or fp16 autocast for --precision bf16-mixed or fp16-mixed, unless the
        strategy applies it itself."""
        return self.strategy.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate `loss` and synchronise gradients as the strategy requires (for
        loops written by hand; the loss is watched, and the step timed and its samples
        counted, as in `train_step`: from the first call on, the forward of the model
        `setup` returned starts a step's micro-batch, and this call ends its forward).
        Under fp16-mixed the loss is multiplied by the loss scale first."""
        self._require_setup("engine.backward")
        self.observers.on_backward_start(self.position.step + 1, loss)
        if self.loss_scaling is not None:
            self.loss_scaling.backward()
            loss = self.loss_scaling.scale(loss)
        self.strategy.backward(self.observers.watch_backward(loss))
        self.observers.on_backward_end()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside this block, backward accumulates gradients without synchronising."""
        self._require_setup("engine.no_sync")
        return self.strategy.no_sync()

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, loader: Iterable[Any], loss_fn: LossFn | None = None) -> dict[str, float]:
        """Mean loss (and accuracy for classifiers) over `loader`, reduced over workers.

        Batches take the shapes `train_step` takes; the loss is `loss_fn`'s, or with
        ``loss_fn=None`` the one the model returns (none for a model that returns none).
        The model is switched to eval mode (batch norm, dropout) and back. Accuracy is
        reported when the outputs (or their ``logits``) are (N, C) and the targets (or the
        batch's ``labels``) (N,) class indices. Each result is also logged as ``eval/*``.
        """
        self._require_setup("engine.evaluate")
        self.strategy.refresh()
        batches = (self.to_device(batch) for batch in loader)
        device = self.topology.device
        collective = self.strategy.placement.collective_forward
        extra = shortfall(loader, self.strategy, device) if collective else 0
        result = evaluate(self.strategy, batches, loss_fn, self.autocast, device, extra)
        self.report.log({f"eval/{k}": v for k, v in result.items()}, self.step)
        return result

    # -- teardown -------------------------------------------------------------------------
    def close(self, *, failed: bool = False) -> None:
        """Print where the time went, release the strategy's wrappers, then leave the
        process group (once; done at exit if the script does not call it). `failed`: the
        script is ending on an error, so the end-of-run summary, which needs every rank,
        is skipped.

        An asynchronous checkpoint save that failed does not cut this short: the metrics
        JSON, the summary and the teardown happen first, then its CheckpointError is
        raised (once; a second close does nothing).

        The group is destroyed only once no wrapped model (DDP) is still referenced:
        destroying it under a live DDP object can abort the process on gloo.
        """
        if self._closed:
            return
        self._closed = True
        forget(self)
        if not hasattr(self, "observers"):  # __init__ stopped part way: nothing ran yet
            release(self.strategy, None)
            return
        save_error: CheckpointError | None = None
        try:
            self.checkpoints.finish()
        except CheckpointError as e:
            save_error = e  # raised once the rest of close is done
        self.observers.on_close(
            End(
                together=self.model is not None and not failed,  # collectives allowed
                steps=self.step,
                last_checkpoint=self.checkpoints.last_path,
                results={
                    "strategy": self.strategy.name,
                    "world_size": self.world_size,
                    "steps": self.step,
                },
            )
        )
        wrapped = weakref.ref(self.model) if self.model is not None else None
        self.model = None
        release(self.strategy, wrapped)
        if save_error is not None:
            raise save_error

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
