"""Run pipeline stages under a `torch.distributed.pipelining` schedule.

GPipe (Huang et al. 2019) runs every micro-batch's forward, then every backward: the
bubble is (P-1)/(M+P-1) of the step and all M micro-batches' activations are alive at
once. 1F1B (PipeDream-Flush, Narayanan et al. 2021) has the same bubble but alternates
forward and backward once the pipe is full, so a stage holds at most P micro-batches of
activations. Interleaved 1F1B gives each rank V stages and cuts the bubble by V.

A weight tied across stages (an embedding and the output head) is kept as Megatron-LM
keeps it: a copy on each stage that uses it, the copies' gradients summed once a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.errors import SetupError
from dtrain.parallel.relay import relay_forward
from dtrain.parallel.stage_checks import Tie
from dtrain.step.batches import DictFeed, Weight, pipeline_parts, weigh
from dtrain.step.precision import LossScaling

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _laid_out_as(param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """`grad` laid out as `param` is. A tensor-parallel embedding's weight sharded like
    the head it is tied to may get a replicated gradient; its shard is cut out locally."""
    placed = isinstance(grad, DTensor) and isinstance(param, DTensor)
    if placed and grad.placements != param.placements:  # type: ignore[union-attr]
        return grad.redistribute(param.device_mesh, param.placements)  # type: ignore[union-attr]
    return grad


class TiedWeights:
    """Parameters several stages hold (a tied embedding and output head), kept as one.

    Each stage that uses one holds a copy; the copies start from the first holding stage's
    value, and once a step their gradients are summed over the pipeline ranks, so every
    copy takes the update the single parameter of the unsplit model takes. Ranks that
    hold no copy add zeros (one all-reduce over the pipeline group per tie). A copy given
    no gradient in a step gets the others' sum.
    """

    def __init__(
        self,
        ties: list[Tie],
        stages: dict[int, nn.Module],
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.group = group
        self.device = device
        self._stages = stages
        size = dist.get_world_size(group)
        me = dist.get_rank(group)
        self._names = [next((n for s, n in tie.names.items() if s in stages), None) for tie in ties]
        self._counts = [min(tie.names) % size == me for tie in ties]
        mine = [self._layout(name) for name in self._names]
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        self._layouts = []
        for i, tie in enumerate(ties):
            layouts = {layout[i] for layout in everyone if layout[i] is not None}
            if len(layouts) > 1:
                raise SetupError(
                    f"The tied parameter {' = '.join(tie.names.values())} is laid out "
                    f"differently on the stages holding it ({sorted(map(str, layouts))}); "
                    "shard both uses alike (one tensor-parallel style), or untie them."
                )
            self._layouts.append(layouts.pop())
        with torch.no_grad():
            for i, param in enumerate(self._params()):
                first = _local(param) if param is not None and self._counts[i] else None
                total = self._sum(i, first)
                if param is not None:
                    _local(param).copy_(total)

    def _param(self, name: str | None) -> nn.Parameter | None:
        for module in self._stages.values() if name is not None else ():
            with contextlib.suppress(AttributeError):
                return module.get_parameter(name)
        return None

    def _params(self) -> list[nn.Parameter | None]:
        # Looked up each time: data parallelism may put other parameter objects in place.
        return [self._param(name) for name in self._names]

    def _layout(self, name: str | None) -> tuple[tuple[int, ...], torch.dtype, str] | None:
        param = self._param(name)
        if param is None:
            return None
        placements = str(param.placements) if isinstance(param, DTensor) else ""
        return tuple(_local(param).shape), param.dtype, placements

    def _sum(self, i: int, tensor: torch.Tensor | None) -> torch.Tensor:
        """The sum over the pipeline ranks of `tensor` (zeros where None) for tie `i`."""
        shape, dtype, _ = self._layouts[i]
        total = torch.zeros(shape, dtype=dtype, device=self.device)
        if tensor is not None:
            total.copy_(tensor)
        dist.all_reduce(total, group=self.group)
        return total

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Give every copy the sum of the copies' gradients (once a step, after the last
        micro-batch's backward and the data-parallel reduction, before clipping)."""
        for i, param in enumerate(self._params()):
            grad = None if param is None else _laid_out_as(param, param.grad)
            total = self._sum(i, None if grad is None else _local(grad))
            if param is None:
                continue
            if grad is None:
                grad = torch.zeros_like(param)
            _local(grad).copy_(total)
            param.grad = grad

    def copies(self) -> list[nn.Parameter]:
        """This rank's copies whose gradient another rank counts in the norm for clipping
        (a tied parameter counts once, as in the unsplit model)."""
        pairs = zip(self._params(), self._counts, strict=True)
        return [p for p, counts in pairs if p is not None and not counts]


class Pipeline:
    """This rank's stages of a P-rank pipeline and the schedule that drives them."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        num_stages: int,
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        ties: list[Tie] | None = None,
        feed: DictFeed | None = None,
    ) -> None:
        self.modules = stages
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.group = group
        self.rank = dist.get_rank(group)
        self.last_rank = dist.get_global_rank(group, (num_stages - 1) % dist.get_world_size(group))
        self.has_last = (num_stages - 1) in stages
        self.feed = feed
        """How a dict batch drives the stages, for a model that computes its own loss."""
        self._loss_fn: LossFn | None = None
        self._count: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._weight: Weight = 1.0
        self._scaling: LossScaling | None = None
        self._shape: torch.Size | None = None
        # Imported here: torch's pipelining pulls in its compiler (a second or more of
        # start-up per process), which runs without a pipeline never need.
        from dtrain.parallel.schedule import TimedStage, schedule_for

        self.stages = [
            TimedStage(module, index, num_stages, device, group=group)
            for index, module in sorted(stages.items())
        ]
        self.compute_seconds = {index: 0.0 for index in stages}
        """Each of this rank's stages' compute time, summed over the steps."""
        self.steps = 0
        self.tied = TiedWeights(ties or [], stages, group, device)
        """The weights tied across stages, their copies' gradients summed each step."""
        self._accumulating = False
        # Each micro-batch's loss is divided by M here (not by the schedule afterwards) so
        # gradients accumulated over several steps are never rescaled.
        options = {"loss_fn": self._scaled_loss, "scale_grads": False}
        self.schedule = schedule_for(schedule, self.stages, microbatches, **options)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        loss = self._loss_fn(output, target)
        if self._count is None:
            loss = weigh(loss, self._weight / self.microbatches)
        else:  # a mean over the micro-batch's labels weighs as many labels' losses
            loss = weigh(loss, self._weight * self._count(target))
        # fp16-mixed: the last stage back-propagates the scaled loss, so every stage's
        # gradients carry the scale (each rank unscales its own before the step).
        return loss if self._scaling is None else self._scaling.scale(loss)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        scaling: LossScaling | None = None,
        extras: dict[str, torch.Tensor] | None = None,
        weight: Weight = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of one batch through every stage, the loss times `weight`
        (the batch's in the step) and the loss scale of `scaling` (fp16-mixed) if given;
        the batch's mean loss times `weight` (a float64 scalar on the device, not read
        back), on every rank of the pipeline. `extras` (N, ...) tensors are cut into
        micro-batches like the inputs and given to every stage. The micro-batches weigh
        alike, or by their labels when the loss is the feed's label mean."""
        if inputs.shape[0] % self.microbatches:
            raise SetupError(
                f"A batch of {inputs.shape[0]} sample(s) cannot be cut into --microbatches "
                f"{self.microbatches} equal micro-batches; use a per-worker batch size "
                "divisible by the micro-batch count."
            )
        if self._shape is None:
            self._shape = inputs.shape
        elif inputs.shape != self._shape:
            raise SetupError(
                f"This pipeline's micro-batch shapes were fixed at its first step by a batch "
                f"of shape {list(self._shape)}; got {list(inputs.shape)}. Every training "
                "batch must have the same shape: keep drop_last=True (engine.dataloader's "
                "default) and pad sequences to one length."
            )
        self._loss_fn, self._scaling = loss_fn, scaling
        count = self.feed.count if self.feed is not None and loss_fn is self.feed.loss else None
        self._count = count
        self._weight = weight if count is None else weight / count(targets)
        # The schedule's own list holds the M micro-batches' losses only: torch also calls
        # the loss function once on uninitialised outputs while it learns the shapes at
        # the first step. return_outputs=False: the last stage frees each micro-batch's
        # output after its backward instead of keeping all M for a merged result.
        losses: list[torch.Tensor] = []
        self.schedule.step(
            inputs, target=targets, losses=losses, return_outputs=False, **(extras or {})
        )
        if not self._accumulating:
            self.tied.sum_gradients()
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        if self.has_last:
            total += sum(loss.detach().double() for loss in losses)
            if scaling is not None:  # the losses carry the loss scale (a power of two)
                total /= scaling.scale(torch.ones((), device=inputs.device)).double()
        dist.broadcast(total, src=self.last_rank, group=self.group)
        for stage in self.stages:
            self.compute_seconds[stage.stage_index] += stage.take_seconds()
        self.steps += 1
        return total

    def watch_outputs(self, watch: Callable[[torch.Tensor], object]) -> None:
        """Hand each stage's output of a step's last micro-batch to `watch`
        (`Handover.output_watch`)."""
        for stage in self.stages:
            stage.watch = watch

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Steps inside the block accumulate gradients for a later one: tied weights'
        gradients are summed once, over the accumulated gradient, by the step after it."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def settle_timers(self) -> None:
        """Count every recorded micro-batch's compute time (waits for the device once)."""
        for stage in self.stages:
            self.compute_seconds[stage.stage_index] += stage.take_seconds(wait=True)

    def figures(self, schedule: str, world_size: int) -> dict[str, object]:
        """The schedule, each stage's layers and its compute time per step, averaged over
        the ranks running it (a collective over all `world_size` ranks): an unbalanced
        split shows as one stage computing longer."""
        from dtrain.parallel.split import layout_of  # split knows the pipeline's feed

        self.settle_timers()
        per_step = 1000 / max(self.steps, 1)
        mine = {
            s: (layout_of(module).layer_names, self.compute_seconds[s] * per_step)
            for s, module in self.modules.items()
        }
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, mine)
        stages: dict[int, tuple[list[str], list[float]]] = {}
        for part in everyone:
            for s, (names, ms) in part.items():
                stages.setdefault(s, (names, []))[1].append(ms)
        order = sorted(stages)
        return {
            "schedule": f"{schedule}, {self.microbatches} micro-batches",
            "stages": " / ".join("+".join(stages[s][0]) for s in order),
            "stage_compute_ms": " / ".join(
                f"{sum(stages[s][1]) / len(stages[s][1]):.1f}" for s in order
            ),
        }


class PipelineModel(nn.Module):
    """What `engine.setup` returns under a pipeline: this rank's layers (with canonical
    names) and a forward that relays a batch through all stages, for evaluation.

    Training goes through `engine.train_step`, whose schedule runs forward and backward.
    Its own attributes carry dtrain's prefix, clear of any name the model uses.
    """

    def __init__(self, local: nn.Module, pipeline: Pipeline) -> None:
        super().__init__()
        self._dtrain_local = local
        self._dtrain_pipeline = pipeline

    def forward(self, *args: Any, **batch: Any) -> Any:
        """The last stage's output for ``model(x)``, on every rank (no gradient). Called
        with a dict batch (``model(**batch)``) of a model that computes its own loss, a
        dict of its ``logits`` and, given the targets, its ``loss``."""
        if torch.is_grad_enabled():
            raise SetupError(
                "Under a pipeline, forward and backward of training run inside "
                "engine.train_step(batch, loss_fn); call the model directly only under "
                "torch.no_grad() (evaluation), or use engine.evaluate."
            )
        p = self._dtrain_pipeline
        if not batch:
            (x,) = args
            return relay_forward(x, p.modules, p.num_stages, p.group)
        inputs, targets, extras, loss = pipeline_parts(batch, None, p.feed, training=False)
        logits = relay_forward(inputs, p.modules, p.num_stages, p.group, extras)
        if targets is None or loss is None:
            return {"logits": logits}
        return {"logits": logits, "loss": loss(logits, targets)}
