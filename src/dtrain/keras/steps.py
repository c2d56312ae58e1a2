"""What a Keras train or test step owes the trainer besides the forward and the update."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.keras.backend import keras


def track_loss(model: Any, loss: torch.Tensor, y_pred: Any) -> None:
    """Feed `loss` to `model`'s "loss" metric weighted by the batch's size, as Keras's own
    steps do, so the epoch's loss is the mean over samples, not over batches."""
    samples = keras.tree.flatten(y_pred)[0].shape[0]
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss, sample_weight=samples)
