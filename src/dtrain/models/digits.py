"""Classifiers for the 8x8 handwritten digits (inputs (N, 1, 8, 8) in [0, 1], 10 classes).

No dropout, so runs are comparable across strategies.
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsMLP(nn.Module):
    """64 -> hidden -> hidden -> 10 multilayer perceptron with ReLU."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, 8, 8) images -> (N, 10) logits."""
        return self.net(x)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels // 2, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels // 2, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(channels * 16, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, 8, 8) images -> (N, 10) logits."""
        return self.head(self.features(x))
