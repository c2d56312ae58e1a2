"""The checks of a pipeline split: every tensor of the model in exactly one stage, held
through the model's own modules, and the parameters tied across stages (an embedding and
the output head it shares a weight with) found, each on its own pipeline rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.parallel.split import Stage, layout_of


@dataclass(frozen=True)
class Tie:
    """A trainable parameter held by several stages, each under its own name in the model
    (a tied embedding and output head)."""

    names: dict[int, str]
    """Stage index -> the name that stage holds it by."""


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` under each of its names."""
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def _layers_holding(stage: Stage, tensor: torch.Tensor) -> str:
    layers = layout_of(stage).layers
    held = [n for n, layer in layers if any(t is tensor for t in _tensors(layer).values())]
    return ", ".join(f"'{n}'" for n in held)


def check_stages(model: nn.Module, stages: list[Stage], ranks: int) -> list[Tie]:
    """Refuse a split where a tensor of `model` is left out, held by a layer outside the
    model's modules, or a parameter held under one name by two stages (a wrapper holding
    more than its forward uses); return the parameters tied across stages (one name per
    stage, on different of the `ranks` pipeline ranks: stage s runs on rank s mod `ranks`).

    A buffer (no gradient: a rotary table) may be held by several stages that use it: each
    rank keeps its copy, and a checkpoint has it once, under its name."""
    kind = type(model).__name__
    holders: dict[str, list[int]] = {}
    held: dict[int, dict[int, str]] = {}  # id(tensor) -> stage -> name
    for s, stage in enumerate(stages):
        ids = {id(t) for t in _tensors(stage).values()}
        for name, layer in layout_of(stage).layers:
            outside = [n for n, t in _tensors(layer).items() if id(t) not in ids]
            if outside:
                raise ConfigError(
                    f"Pipeline layer '{name}' of {kind} holds {', '.join(outside[:5])} "
                    "directly rather than through a submodule of the model, so a pipeline "
                    "stage cannot keep it under its name in the model; give the layer the "
                    "model's submodules that own these tensors (or, for a tensor the model "
                    "holds itself, register that very tensor on the layer)."
                )
        for name, tensor in _tensors(stage).items():
            holders.setdefault(name, []).append(s)
            held.setdefault(id(tensor), {}).setdefault(s, name)
    for name, where in holders.items():
        tensor = _tensors(stages[where[0]])[name]
        if len(where) > 1 and isinstance(tensor, nn.Parameter):
            layers = " and ".join(
                f"{_layers_holding(stages[s], tensor)} (stage {s})" for s in where
            )
            raise ConfigError(
                f"Pipeline layers {layers} of {kind} all hold {name}, but each parameter "
                "and buffer belongs to one stage; give each wrapper layer only the "
                "submodules its forward uses (the embeddings, say, not the whole "
                "transformer that also holds the blocks)."
            )
    missing = [n for n, t in _tensors(model).items() if id(t) not in held]
    if missing:
        raise ConfigError(
            f"The pipeline layers of {kind} leave out {', '.join(missing[:5])}; every "
            "parameter and buffer must belong to a listed layer. A layer whose forward "
            "uses a tensor the model holds itself (a rotary table passed to each block) "
            "registers it: self.register_buffer(name, model.name, persistent=False)."
        )
    params = {id(p): p for p in model.parameters()}
    ties = [
        Tie(names)
        for key, names in held.items()
        if len(names) > 1 and key in params and params[key].requires_grad
    ]
    for tie in ties:
        if len({s % ranks for s in tie.names}) < len(tie.names):
            raise ConfigError(
                f"{' and '.join(tie.names.values())} are one tied parameter held by stages "
                f"{', '.join(map(str, tie.names))}, which run on the same pipeline rank; "
                "dtrain sums a tied weight's gradient across ranks only. Use another "
                "--virtual-stages or --split-points, or untie the weights."
            )
    return ties
