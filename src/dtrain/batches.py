"""Batches of any structure: how the model is called on one, where its loss comes from, and
how it is moved and cut along its first (sample) dimension.

Three shapes of batch, the same under every strategy:

- ``(inputs, targets)``, a tuple or list of two: ``output = model(inputs)`` and the loss is
  ``loss_fn(output, targets)``.
- a dict or other mapping (a Hugging Face batch): ``output = model(**batch)`` and the loss is
  ``loss_fn(output, batch)``, or with ``loss_fn=None`` the output's own ``.loss`` /
  ``["loss"]`` (a model given ``labels`` computes it).
- anything else (a tensor, or a nesting of tensors, tuples, lists and dicts):
  ``output = model(batch)`` and the loss is ``loss_fn(output, batch)`` or, with
  ``loss_fn=None``, the output's own loss.

Every tensor with at least one dimension is cut along dim 0, so all of them must share
that size (the batch's samples); 0-d tensors and other values go whole to every part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError, SetupError

LossFn = Callable[[Any, Any], torch.Tensor]


def is_pair(batch: Any) -> bool:
    """True if `batch` is an ``(inputs, targets)`` pair."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it moved to `device` (without waiting for the copy)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _sizes(batch: Any, path: str, found: dict[str, int]) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            found[path or "batch"] = batch.shape[0]
    elif isinstance(batch, (tuple, list)):
        for i, part in enumerate(batch):
            _sizes(part, f"{path}[{i}]", found)
    elif isinstance(batch, Mapping):
        for key, part in batch.items():
            _sizes(part, f"{path}[{key!r}]", found)


def batch_size(batch: Any) -> int:
    """The number of samples in `batch`: the shared first dimension of its tensors.

    Raises SetupError naming the parts when they disagree, or when there is no tensor.
    """
    found: dict[str, int] = {}
    _sizes(batch, "", found)
    if not found:
        raise SetupError(
            f"A batch of {type(batch).__name__} holds no tensor with a sample dimension; "
            "give engine.train_step tensors (an (inputs, targets) pair, a dict, or a nesting "
            "of tensors) whose first dimension counts the samples."
        )
    if len(set(found.values())) > 1:
        parts = ", ".join(f"{path} has {n}" for path, n in found.items())
        raise SetupError(
            f"The parts of a batch must share their first (sample) dimension, but {parts}. "
            "Make every tensor of the batch hold one row per sample (pass per-batch "
            "constants as 0-d tensors, or set them on the model instead)."
        )
    return next(iter(found.values()))


def split(batch: Any, parts: int) -> list[Any]:
    """Cut `batch` into `parts` pieces along its first dimension (`torch.tensor_split`
    sizes: the first pieces one larger when it does not divide)."""
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, (tuple, list)):
        columns = [split(b, parts) for b in batch]
        return [type(batch)(column[i] for column in columns) for i in range(parts)]
    if isinstance(batch, Mapping):
        columns = {k: split(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in columns.items()} for i in range(parts)]
    return [batch] * parts


def has_own_loss(output: Any) -> bool:
    """True if the model's `output` carries its own loss (``.loss`` / ``["loss"]``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return isinstance(loss, torch.Tensor)


def model_output_loss(output: Any) -> torch.Tensor:
    """The loss a model returned itself (``output.loss`` or ``output["loss"]``)."""
    if not has_own_loss(output):
        raise SetupError(
            f"loss_fn=None takes the loss from the model's output, but the "
            f"{type(output).__name__} it returned has no 'loss' tensor. Pass the labels in the "
            "batch (Hugging Face models compute the loss when given labels=...), or pass a "
            "loss_fn: engine.train_step(batch, loss_fn)."
        )
    return output["loss"] if isinstance(output, Mapping) else output.loss


def call_model(model: nn.Module, batch: Any) -> Any:
    """The model's output on `batch`: ``model(inputs)`` for a pair, ``model(**batch)`` for
    a mapping, ``model(batch)`` otherwise."""
    if is_pair(batch):
        return model(batch[0])
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


def batch_loss(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The batch's mean loss from the model's `output`, as the module docstring says."""
    if loss_fn is not None:
        return loss_fn(output, batch[1] if is_pair(batch) else batch)
    if is_pair(batch):
        raise SetupError(
            "An (inputs, targets) batch needs a loss_fn: engine.train_step(batch, loss_fn) "
            "computes loss_fn(model(inputs), targets). For a model that computes its own "
            "loss, pass a dict batch with the labels (model(**batch) then returns .loss)."
        )
    return model_output_loss(output)


def forward_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> tuple[Any, torch.Tensor]:
    """(the model's output on `batch`, the batch's mean loss)."""
    output = call_model(model, batch)
    return output, batch_loss(output, batch, loss_fn)


def check_batch(global_batch: int, dp_size: int, splits: int, grad_accumulation: int) -> int:
    """The per-worker batch for `global_batch`; a ConfigError if it does not divide evenly."""
    if global_batch < dp_size:
        raise ConfigError(
            f"--global-batch-size {global_batch} is smaller than the {dp_size} data-parallel "
            "workers; every worker needs at least one sample per step. Raise the batch or use "
            "fewer processes."
        )
    if global_batch % dp_size:
        raise ConfigError(
            f"--global-batch-size {global_batch} does not divide evenly over {dp_size} "
            f"data-parallel workers; use a multiple of {dp_size}, e.g. "
            f"{(global_batch // dp_size + 1) * dp_size}."
        )
    per_worker = global_batch // dp_size
    parts = splits * grad_accumulation
    if per_worker % parts:
        raise ConfigError(
            f"Each worker's batch of {per_worker} does not split evenly into {splits} part(s) "
            f"(towers or pipeline micro-batches) x {grad_accumulation} accumulation "
            f"micro-batch(es); use a global batch that is a multiple of {dp_size * parts}."
        )
    return per_worker
