"""The bundled models' recipes: which data, loss and default settings go with each model.

* ``cnn``, ``mlp``: classify scikit-learn's handwritten digits (8x8 images, 10 classes);
  SGD with momentum; reported as test accuracy.
* ``gpt``: byte-level language modelling of the English text that ships with
  scikit-learn; AdamW; reported as test loss and perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dtrain.command_names import OPTIMIZERS
from dtrain.datasets import load_digits, load_text
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, lm_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Task:
    """A model family's data, loss and default hyperparameters."""

    description: str
    loss: LossFn
    epochs: int
    global_batch_size: int
    lr: float
    optimizer: str
    classes: int | None
    """The classes of a classification task; None for language modelling."""

    def data(self, model: nn.Module) -> tuple[Dataset, Dataset]:
        """(train, test) data sets fitting `model`."""
        if isinstance(model, GPT):
            return load_text(context=model.config.context)
        return load_digits()

    def metrics(self, result: dict[str, float]) -> dict[str, float | None]:
        """Metrics JSON fields from `engine.evaluate`'s result."""
        loss = result.get("loss")
        if self.classes is not None:
            return {"test_loss": loss, "test_accuracy": result.get("accuracy")}
        return {"test_loss": loss, "test_perplexity": math.exp(loss) if loss is not None else None}


    def batch_note(self, global_batch_size: int) -> str | None:
        """A note when `global_batch_size` passes the rule of thumb for classes of data of
        low diversity (about ten samples per class per step); None otherwise."""
        if self.classes is None or global_batch_size <= BATCH_PER_CLASS * self.classes:
            return None
        return (
            f"a global batch of {global_batch_size} holds more than {BATCH_PER_CLASS} "
            f"samples per class of the {self.description} ({self.classes} classes). A common "
            "rule of thumb caps the batch there for data of low diversity: a larger batch "
            "adds little to each step and needs more epochs to reach the same accuracy. "
            f"Give it more epochs (--epochs), or keep the batch near "
            f"{BATCH_PER_CLASS * self.classes}."
        )


BATCH_PER_CLASS = 10
"""The rule of thumb's cap on the global batch, in samples per class, for data of low
diversity (few distinct samples per class)."""

DIGITS = Task("digits", F.cross_entropy, 12, 64, 0.1, "sgd", classes=10)
TEXT = Task("text", lm_loss, 4, 32, 3e-3, "adamw", classes=None)
TASKS = {"cnn": DIGITS, "mlp": DIGITS, "gpt": TEXT}


def make_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, or AdamW (weight decay 0.01), over `model`'s parameters."""
    if kind not in OPTIMIZERS:
        raise ConfigError(f"Unknown --optimizer '{kind}'; choose one of {', '.join(OPTIMIZERS)}.")
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
