"""Real English text that ships with scikit-learn (its data sets' descriptions, ~43 KB),
as byte-level language-modelling samples. Nothing is downloaded."""

from __future__ import annotations

from importlib import resources

import torch
from torch.utils.data import TensorDataset


def corpus() -> bytes:
    """The text: scikit-learn's data-set descriptions, concatenated in name order."""
    folder = resources.files("sklearn.datasets") / "descr"
    parts = sorted(p for p in folder.iterdir() if p.name.endswith(".rst"))
    return b"\n\n".join(p.read_bytes() for p in parts)


def load_text(context: int = 64, test_fraction: float = 0.1) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of (inputs, targets), each (N, context) byte ids in [0, 256).

    Samples are consecutive windows; targets are inputs shifted by one byte. The test set
    is the last `test_fraction` of the text, so no test window overlaps a training one.
    """
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    split = int(len(data) * (1 - test_fraction))

    def windows(tokens: torch.Tensor) -> TensorDataset:
        count = (len(tokens) - 1) // context
        x = tokens[: count * context].view(count, context)
        y = tokens[1 : count * context + 1].view(count, context)
        return TensorDataset(x, y)

    return windows(data[:split]), windows(data[split:])
