"""How much each share of a batch counts when its loss is a mean over labels, not samples.

A Hugging Face model given ``labels`` returns the mean loss over the labels it scores:
those that are not -100 (the ignore index: padding, prompt tokens), and for a causal LM
only the labels after the first of each row (it predicts token t+1 from token t). When a
step's batch is cut into shares (data-parallel processes, accumulation micro-batches,
towers, pipeline micro-batches) holding unequal counts of such labels, the mean of the
shares' means is not the batch's mean: one device weighs every label alike, the split
step every share alike. So a share's loss is weighted by its count of labels over the
batch's count, which for the data-parallel processes is one all-reduce of a scalar per
step, left on the device (nothing waits for it on the host).

Batches with a `loss_fn` of the user's, and models that are not Hugging Face models,
keep the samples' weights: their loss is taken to be a mean over samples.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.batches import LossFn, batch_size

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
