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

Under a pipeline the first stage takes the inputs and the last computes the loss, so a
batch is taken apart (`pipeline_parts`): a pair as above, or a dict batch for a model
that computes its own loss (a Hugging Face model split by its pp plan, `DictFeed`).

How much each share of a cut batch counts (`share_weights`): its share of the samples,
or, for a Hugging Face model's own loss, of the labels that loss averages over. That loss
is the mean over the labels that are not -100 (the ignore index: padding, a prompt), and
for a causal LM only over those after the first of each row (it predicts token t+1 from
token t). When a step's batch is cut into shares (data-parallel processes, accumulation
micro-batches, towers, pipeline micro-batches) holding unequal counts of such labels, the
mean of the shares' means is not the batch's mean: one device weighs every label alike,
the split step every share alike. So a share's loss is weighted by its count of labels
over the batch's count, which for the data-parallel processes is one all-reduce of a
scalar per step, left on the device (nothing waits for it on the host). A `loss_fn` of
the user's, and models that are not Hugging Face models, keep the samples' weights: their
loss is taken to be a mean over samples.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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


def _first_dims(batch: Any, path: str | None, found: list[tuple[str | None, int]]) -> None:
    """Append (the part's path, or None when `path` is None; its first dimension) for
    every tensor of `batch` that has one."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            found.append(((path or "batch") if path is not None else None, batch.shape[0]))
    elif isinstance(batch, (tuple, list)):
        for i, part in enumerate(batch):
            _first_dims(part, None if path is None else f"{path}[{i}]", found)
    elif isinstance(batch, Mapping):
        for key, part in batch.items():
            _first_dims(part, None if path is None else f"{path}[{key!r}]", found)


def batch_size(batch: Any) -> int:
    """The number of samples in `batch`: the shared first dimension of its tensors.

    Raises SetupError naming the parts when they disagree, or when there is no tensor.
    """
    found: list[tuple[str | None, int]] = []
    _first_dims(batch, None, found)  # every step: the parts are named only for a message
    if found and all(n == found[0][1] for _, n in found):
        return found[0][1]
    if not found:
        raise SetupError(
            f"A batch of {type(batch).__name__} holds no tensor with a sample dimension; "
            "give engine.train_step tensors (an (inputs, targets) pair, a dict, or a nesting "
            "of tensors) whose first dimension counts the samples."
        )
    named: list[tuple[str | None, int]] = []
    _first_dims(batch, "", named)
    parts = ", ".join(f"{path} has {n}" for path, n in named)
    raise SetupError(
        f"The parts of a batch must share their first (sample) dimension, but {parts}. "
        "Make every tensor of the batch hold one row per sample (pass per-batch "
        "constants as 0-d tensors, or set them on the model instead)."
    )


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


@dataclass(frozen=True)
class DictFeed:
    """How a dict batch drives a pipeline whose model computes its own loss: which key the
    first stage takes, which keys every stage is given, and the loss on the last stage's
    output and the targets."""

    inputs: str
    """The key of the first stage's input (``input_ids``)."""
    targets: str
    """The key of the targets the loss is computed against (``labels``)."""
    extras: tuple[str, ...]
    """Keys every stage is given besides the activation (``attention_mask``)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """The model's own loss: ``loss(last stage's output, targets)``, a batch mean."""
    count: Callable[[torch.Tensor], torch.Tensor] | None
    """How many of the targets that mean is over (None: a mean over samples)."""
    model: str
    """The model's class, for messages."""


PipelineParts = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor], LossFn | None]


def pipeline_parts(
    batch: Any, loss_fn: LossFn | None, feed: DictFeed | None, training: bool = True
) -> PipelineParts:
    """(the first stage's input, the targets, what every stage is given besides, the loss
    function) of `batch` under a pipeline: an ``(inputs, targets)`` pair with `loss_fn`,
    or a dict batch fed by `feed` with the model's own loss. Outside `training` the
    targets and the loss may be missing (None). Refuses by name what a pipeline cannot
    honour."""
    if is_pair(batch) and (loss_fn is not None or not training):
        inputs, targets = batch
        return inputs, targets, {}, loss_fn
    if not isinstance(batch, Mapping) or feed is None:
        raise SetupError(
            "Under a pipeline the last stage computes the loss from its output and the "
            "targets, so engine.train_step needs an (inputs, targets) batch of tensors and "
            "a loss_fn(output, targets). Dict batches whose loss the model computes itself "
            "run split only for Hugging Face causal LMs split by their pp plan; other "
            "models run under the other strategies (ddp, zero3, tensor, ...)."
        )
    if loss_fn is not None:
        raise SetupError(
            f"Under a pipeline, {feed.model} computes its own loss on the last stage from "
            f"the batch's {feed.targets!r}; call engine.train_step(batch) without a loss_fn "
            "(or pass (inputs, targets) pairs with your loss_fn)."
        )
    known = (feed.inputs, feed.targets, *feed.extras)
    unknown = [key for key in batch if key not in known]
    needed = [feed.inputs, feed.targets] if training else [feed.inputs]
    missing = [key for key in needed if batch.get(key) is None]
    if unknown or missing:
        problem = (
            f"has {', '.join(map(repr, unknown))}, which it cannot honour (no cache, no "
            "position ids or embeddings of your own)"
            if unknown
            else f"lacks {', '.join(map(repr, missing))}"
        )
        raise SetupError(
            f"Under a pipeline, a dict batch for {feed.model} gives {feed.inputs!r} to the "
            f"first stage, {', '.join(map(repr, feed.extras))} to every stage and "
            f"{feed.targets!r} to the loss on the last stage; this batch {problem}. Give "
            "only those keys."
        )
    extras = {key: batch[key] for key in feed.extras if batch.get(key) is not None}
    return batch[feed.inputs], batch.get(feed.targets), extras, feed.loss


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


# -- shares weighted by their labels ---------------------------------------------------
IGNORE_INDEX = -100
"""The label Hugging Face losses leave out (their ``ignore_index``)."""

Weight = float | torch.Tensor
"""A share's weight: a Python number, or a 0-d tensor on the device."""


@dataclass(frozen=True)
class LabelCounter:
    """Counts the labels a Hugging Face model's own loss averages over in a dict batch."""

    shifted: bool
    """True for a causal LM: the first label of each row predicts nothing."""

    def applies(self, batch: Any, loss_fn: LossFn | None) -> bool:
        """True if `batch`'s loss is the model's own mean over its labels."""
        return (
            loss_fn is None
            and isinstance(batch, Mapping)
            and isinstance(batch.get("labels"), torch.Tensor)
        )

    def count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The number of labels the loss of `batch` averages over (a 0-d tensor); labels
        a batch gives already shifted (``shift_labels``) count as they are."""
        shifted = batch.get("shift_labels")
        if isinstance(shifted, torch.Tensor):
            return shifted.ne(IGNORE_INDEX).sum()
        return self.count_labels(batch["labels"])

    def count_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of `labels` (one batch's, or one micro-batch's) the loss scores."""
        if self.shifted and labels.dim() > 1:
            labels = labels[..., 1:]
        return labels.ne(IGNORE_INDEX).sum()


def label_counter(model: nn.Module) -> LabelCounter | None:
    """The counter for `model`'s own loss if it is a Hugging Face model's (None otherwise:
    its shares are weighted by their samples). A model compiled by ``torch.compile`` is
    looked at through its wrapper."""
    if "transformers" not in sys.modules:  # a Hugging Face model was never built here
        return None
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, PreTrainedModel):
        return None
    # As the model's `loss_function` resolves it (a loss set on the model, else its loss
    # type's, else the causal LM's), without the warning that property logs.
    loss = model.__dict__.get("_loss_function") or LOSS_MAPPING.get(
        getattr(model, "loss_type", None) or "ForCausalLM", ForCausalLMLoss
    )
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    return LabelCounter(shifted=loss is ForCausalLMLoss and not encoder_decoder)


def share_weights(
    shares: Sequence[Any],
    loss_fn: LossFn | None,
    counter: LabelCounter | None,
    group: dist.ProcessGroup | None = None,
    replicas: int = 1,
) -> list[Weight]:
    """The weight of each of the `shares` one process cuts its batch into: its loss is
    back-propagated times it, and the weighted losses' sum is what the process reports.

    Samples weigh alike unless `counter` applies to the batch; then labels do. Where the
    step averages the gradients of `replicas` processes over `group` (data parallel), the
    weights make that average the mean over all their labels (an all-reduce of the label
    count over `group`), and the mean of what the processes report is the global batch's
    mean loss.
    """
    if len(shares) == 1 and replicas == 1:
        return [1.0]
    if counter is None or not counter.applies(shares[0], loss_fn):
        sizes = [batch_size(share) for share in shares]
        return [n / sum(sizes) for n in sizes]
    counts = [counter.count(share) for share in shares]
    total = torch.stack(counts).sum()
    if replicas > 1:
        dist.all_reduce(total, group=group)
    return [count * replicas / total for count in counts]


def weigh(loss: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`loss` times `weight`; a share weighted 0 (it holds no label, so its mean loss is
    NaN) adds nothing. A weight that is the number 1 leaves `loss` as it is."""
    if isinstance(weight, torch.Tensor):
        return torch.where(weight > 0, loss * weight, 0.0)
    return loss if weight == 1 else loss * weight
