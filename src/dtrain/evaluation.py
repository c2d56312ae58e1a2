"""Evaluation sums: loss and, for classifiers, correct predictions over batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def evaluation_sums(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
    autocast: Callable[[], contextlib.AbstractContextManager[None]],
    device: torch.device,
    extra_forwards: int = 0,
) -> tuple[torch.Tensor, bool]:
    """([loss sum, correct, samples] as float64 on `device`, whether it is a classifier).

    `model` is put in eval mode and back. Accuracy counts when the outputs are (N, C)
    logits and the targets (N,) class indices; the loss sum weights each batch's mean
    loss by its size. `extra_forwards` more forwards of the last batch follow, counted
    nowhere (so that every rank of a collective forward runs as many).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    classifier = True
    try:
        for inputs, targets in batches:
            with autocast():
                outputs = model(inputs)
            n = targets.shape[0]
            if loss_fn is not None:
                totals[0] += float(loss_fn(outputs, targets)) * n
            classifier = classifier and (
                outputs.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point()
            )
            if classifier:
                totals[1] += (outputs.argmax(dim=1) == targets).sum().item()
            totals[2] += n
        for _ in range(extra_forwards if totals[2] else 0):
            with autocast():
                model(inputs)
    finally:
        model.train(was_training)
    return totals, classifier
