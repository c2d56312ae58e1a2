"""Evaluation: the mean loss and, for classifiers, the accuracy over batches and processes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.step.batches import (
    LabelCounter,
    LossFn,
    batch_loss,
    batch_size,
    call_model,
    has_own_loss,
    is_pair,
    weigh,
)
from dtrain.strategies.base import Strategy


def evaluate(
    strategy: Strategy,
    batches: Iterable[Any],
    loss_fn: LossFn | None,
    autocast: Callable[[], contextlib.AbstractContextManager[None]],
    device: torch.device,
    extra_forwards: int,
) -> dict[str, float]:
    """``samples``, and the mean ``loss`` and ``accuracy`` where they count, of `batches`
    (on the device) over every data-parallel process of `strategy` (a collective)."""
    totals, classifier, counted_loss = evaluation_sums(
        strategy.eval_module(), batches, loss_fn, autocast, device, strategy.labels,
        extra_forwards,
    )  # fmt: skip
    if strategy.spec.multiprocess and dist.is_initialized():
        dist.all_reduce(totals, group=strategy.placement.dp_group)
    loss_sum, weight, correct, count = totals.tolist()
    result = {"samples": count}
    if count and counted_loss:
        result["loss"] = loss_sum / weight
    if count and classifier:
        result["accuracy"] = correct / count
    return result


@torch.no_grad()
def evaluation_sums(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn | None,
    autocast: Callable[[], contextlib.AbstractContextManager[None]],
    device: torch.device,
    labels: LabelCounter | None = None,
    extra_forwards: int = 0,
) -> tuple[torch.Tensor, bool, bool]:
    """([loss sum, its weight, correct, samples] as float64 on `device`, whether it is a
    classifier, whether a loss was counted).

    Batches take the shapes `dtrain.step.batches` describes; a batch's loss is counted when
    `loss_fn` is given or the model returns one. `model` is put in eval mode and back.
    Accuracy counts when the outputs (or their ``logits``) are (N, C) and the targets (or
    the batch's ``labels``) (N,) class indices; the loss sum weights each batch's mean
    loss by its size, or by its count of labels where `labels` applies (a Hugging Face
    model's own loss: `dtrain.step.batches`). `extra_forwards` more forwards of
    the last batch follow, counted nowhere (so that every rank of a collective forward
    runs as many).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    classifier = True
    counted_loss = False
    batch: Any = None
    try:
        for batch in batches:
            n = batch_size(batch)
            with autocast():
                outputs = call_model(model, batch)
                if loss_fn is not None or has_own_loss(outputs):
                    loss = batch_loss(outputs, batch, loss_fn).detach().double()
                    weight = labels.count(batch) if labels and labels.applies(batch, loss_fn) else n
                    totals[0] += weigh(loss, weight)
                    totals[1] += weight
                    counted_loss = True
            logits, targets = _logits(outputs), _targets(batch)
            classifier = classifier and (
                logits is not None
                and targets is not None
                and logits.dim() == 2
                and targets.dim() == 1
                and not targets.is_floating_point()
            )
            if classifier:
                totals[2] += (logits.argmax(dim=1) == targets).sum()  # type: ignore[union-attr]
            totals[3] += n
        for _ in range(extra_forwards if totals[3] else 0):
            with autocast():
                call_model(model, batch)
    finally:
        model.train(was_training)
    return totals, classifier, counted_loss


def _logits(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    found = outputs.get("logits") if isinstance(outputs, Mapping) else None
    return found if isinstance(found, torch.Tensor) else None


def _targets(batch: Any) -> torch.Tensor | None:
    found = (
        batch[1] if is_pair(batch) else batch.get("labels") if isinstance(batch, Mapping) else None
    )
    return found if isinstance(found, torch.Tensor) else None


def shortfall(loader: Iterable[Any], strategy: Strategy, device: torch.device) -> int:
    """Batches this rank has fewer than the data-parallel rank with the most (a
    collective over them). Where the model's forward is a collective (sharded parameters
    are gathered in forward), a rank without a share of the last, short batch must still
    take part in as many forwards."""
    if strategy.placement.dp_size == 1:
        return 0
    try:
        length = len(loader)  # type: ignore[arg-type]
    except TypeError:
        # A stream of unknown length (a DataLoader has __len__ whatever it reads): taken
        # only with drop_last=True there, which gives every rank as many batches.
        return 0
    count = torch.tensor([length], device=device)
    most = count.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=strategy.placement.dp_group)
    return int(most.item() - count.item())
