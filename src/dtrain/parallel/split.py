"""Cut a model into pipeline stages: which layers, how balanced, under which names.

A model can be split when its forward is a chain of layers: an `nn.Sequential`, or any
module with a ``pipeline_layers()`` method returning ``[(name, module), ...]`` such that
``model(x)`` equals applying the modules in order (names are the modules' qualified
names in the model, so checkpoints keep their canonical names). The bundled GPT has one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain.errors import ConfigError

Layer = tuple[str, nn.Module]


def layers_of(model: nn.Module) -> list[Layer]:
    """The chain of layers whose composition is `model`'s forward."""
    if isinstance(model, nn.Sequential):
        chain = list(model.named_children())
    elif callable(getattr(model, "pipeline_layers", None)):
        chain = list(model.pipeline_layers())  # type: ignore[operator]
    else:
        raise ConfigError(
            f"Pipeline parallelism cuts a model into a chain of layers, but "
            f"{type(model).__name__} is neither an nn.Sequential nor has a pipeline_layers() "
            "method. Add `def pipeline_layers(self): return [(name, module), ...]` listing, in "
            "forward order, submodules whose composition is the forward (see the bundled GPT "
            "and docs/strategies.md)."
        )
    covered = {id(p) for _, layer in chain for p in layer.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ConfigError(
            f"pipeline_layers() of {type(model).__name__} leaves out parameter(s) "
            f"{', '.join(missing[:5])}; every parameter must belong to one listed layer."
        )
    return chain


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Start index of each of `stages` contiguous groups of `costs`, minimising the largest
    group's total (the slowest stage sets the pipeline's pace)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest possible largest total when the first i layers form s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def split_layers(
    chain: list[Layer], stages: int, split_points: list[str] | None
) -> list[list[Layer]]:
    """`chain` cut into `stages` groups: at `split_points` (names of the layers that begin a
    stage), or balanced by parameter count."""
    names = [name for name, _ in chain]
    if stages > len(chain):
        raise ConfigError(
            f"{stages} pipeline stages need at least {stages} layers, but the model has "
            f"{len(chain)} ({', '.join(names)}); use fewer stages (--pp, or --virtual-stages) "
            "or a deeper model."
        )
    if split_points:
        unknown = [p for p in split_points if p not in names]
        if unknown:
            raise ConfigError(
                f"--split-points {', '.join(unknown)} name no layer; the layers are "
                f"{', '.join(names)}."
            )
        if len(split_points) != stages - 1:
            raise ConfigError(
                f"{stages} stages need {stages - 1} split point(s), got {len(split_points)} "
                f"({', '.join(split_points)})."
            )
        starts = [0, *sorted(names.index(p) for p in split_points)]
        if len(set(starts)) != stages or 0 in starts[1:]:
            raise ConfigError(
                "--split-points must name distinct layers after the first; got "
                f"{', '.join(split_points)}."
            )
    else:
        costs = [sum(p.numel() for p in layer.parameters()) or 1 for _, layer in chain]
        starts = partition(costs, stages)
    ends = [*starts[1:], len(chain)]
    return [chain[a:b] for a, b in zip(starts, ends, strict=True)]


class Stage(nn.Module):
    """Some layers of a chain, held under their names in the whole model, run in order.

    Its ``state_dict`` therefore uses the canonical names: a stage holding ``blocks.3``
    has parameters ``blocks.3.attn.q.weight``, as the unsplit model does.
    """

    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layer_names = [name for name, _ in layers]
        for name, layer in layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, layer)

    @property
    def layers(self) -> list[Layer]:
        """(name, module) of each layer, in forward order."""
        return [(name, self.get_submodule(name)) for name in self.layer_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layers in order."""
        for name in self.layer_names:
            x = self.get_submodule(name)(x)
        return x
