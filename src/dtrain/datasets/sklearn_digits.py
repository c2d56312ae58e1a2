"""scikit-learn's handwritten digits: 1,797 real 8x8 grey images of the digits 0-9."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits as _sklearn_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of images (N, 1, 8, 8) scaled to [0, 1] and labels (N,).

    The split is stratified by class and fixed by `seed`, so every run and every rank
    sees the same held-out test set.
    """
    digits = _sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(),
        test_size=test_fraction,
        random_state=seed,
        stratify=labels.numpy(),
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )
