"""Classifiers for the 8x8 handwritten digits (inputs (N, 1, 8, 8) in [0, 1], 10 classes).

No dropout, so runs are comparable across strategies. Both can be split by every
strategy: their forward is a chain of the children of their `nn.Sequential`s
(``pipeline_layers``), and their hidden linear layers pair up column- then row-wise
(``tensor_parallel_plan``). Parameter names are those of the plain modules (``net.1.weight``,
``features.0.weight``, ...), so checkpoints load under any strategy.
"""

from __future__ import annotations

import torch
from torch import nn

Layer = tuple[str, nn.Module]


def _children(prefix: str, sequential: nn.Sequential) -> list[Layer]:
    """(qualified name, module) of each child of `sequential`, held in the model at `prefix`."""
    return [(f"{prefix}.{name}", module) for name, module in sequential.named_children()]


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

    def pipeline_layers(self) -> list[Layer]:
        """The forward as a chain of (name, module): ``net.0`` (flatten) ... ``net.5``.

        Three linear layers, so up to three stages hold parameters; balanced by parameter
        count, two stages cut before ``net.3``.
        """
        return _children("net", self.net)

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """The first hidden layer split by output columns, the second by input rows.

        Between them each rank holds 1/`degree` of the hidden units (ReLU is element-wise,
        so it runs on the slice), and the row-split layer's all-reduce joins the partial
        sums. The 10-class output layer stays replicated: 10 would divide by few degrees,
        and it is small. `degree` must divide the hidden size (checked by the caller,
        naming the layer).
        """
        return {"net.1": "colwise", "net.3": "rowwise"}


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

    def pipeline_layers(self) -> list[Layer]:
        """The forward as a chain of (name, module): ``features.0`` ... ``features.4``, then
        ``head.0`` ... ``head.3``.

        The first linear layer holds 92% of the parameters, so balanced by parameter count
        two stages cut before it and three put it in a stage of its own.
        """
        return [*_children("features", self.features), *_children("head", self.head)]

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """The linear head's hidden layer split by output columns, the output layer by input
        rows; the convolutions stay replicated.

        The head holds 93% of the parameters; torch's column and row styles split only
        Linear and Embedding layers, and the convolutions are small, so every rank runs
        them whole. `degree` must divide the head's 128 hidden units (checked by the
        caller, naming the layer).
        """
        return {"head.1": "colwise", "head.3": "rowwise"}
