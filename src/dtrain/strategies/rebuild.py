"""Rebuild a user's optimizer on other parameter objects, group by group.

FSDP2's `fully_shard` replaces a module's parameters with sharded DTensor parameters,
`ZeroRedundancyOptimizer` takes the optimizer's class and hyperparameters rather than the
optimizer, and a parameter server holds flat slices of the parameters: each needs the
user's optimizer restated, with every group's settings, over other tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from dtrain.checkpoint.optimizer_state import parameter_names
from dtrain.errors import ConfigError


def group_names(optimizer: Optimizer, model: nn.Module) -> list[list[str]]:
    """Canonical parameter names of each of `optimizer`'s groups, in order."""
    names = parameter_names(model)
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ConfigError(
            "The optimizer holds a parameter that is not in the model; build it from "
            "model.parameters() before engine.setup."
        ) from None


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def constructor_kwargs(optimizer_class: type[Optimizer], group: dict[str, Any]) -> dict[str, Any]:
    """The settings of `group` that `optimizer_class`'s constructor accepts by name.

    Param groups may carry keys the constructor does not take (AdamW's group holds
    ``decoupled_weight_decay``, which its constructor sets itself).
    """
    accepted = inspect.signature(optimizer_class.__init__).parameters
    return {k: v for k, v in hyperparameters(group).items() if k in accepted}


def restate(
    optimizer_class: type[Optimizer],
    settings: Sequence[dict[str, Any]],
    params: Sequence[Sequence[torch.Tensor]],
    defaults: dict[str, Any],
) -> Optimizer:
    """A new `optimizer_class` whose group i holds `params[i]` with the settings
    `settings[i]` (a param group without its parameters); `defaults` become its defaults.

    Every group is kept, empty ones included, so group i still means the user's group i.
    """
    groups = [
        {**hyperparameters(group), "params": list(tensors)}
        for group, tensors in zip(settings, params, strict=True)
    ]
    try:
        # Each group carries every hyperparameter, so the constructor needs none: passing
        # the defaults as keywords would fail on keys a constructor sets itself (AdamW's
        # decoupled_weight_decay).
        new = optimizer_class(groups)
    except TypeError as e:
        raise ConfigError(
            f"dtrain could not rebuild {optimizer_class.__name__} over the sharded "
            f"parameters ({e}); use an optimizer whose constructor takes (params) with "
            "every hyperparameter defaulted, as torch.optim's do."
        ) from None
    new.defaults.update(defaults)
    return new


def has_stepped(optimizer: Optimizer) -> bool:
    """True once `optimizer` has taken a step (Adagrad fills its state at construction,
    with step 0: that state is rebuilt alike wherever the parameters go)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) > 0:
            return True
    return False


NOT_FRESH = (
    "The optimizer has already taken steps; call engine.setup before training, and load a "
    "checkpoint with engine.load afterwards."
)


def repoint(optimizer: Optimizer, names: list[list[str]], model: nn.Module) -> Optimizer:
    """`optimizer` itself, its group i now holding `model`'s parameters called `names[i]`
    (sharded DTensors, or a pipeline stage's subset); every setting is kept.

    The user's object goes on training, so whatever holds it (a learning-rate scheduler
    built before `engine.setup`, a reference kept by the script) keeps working: a new
    optimizer in its place would leave a scheduler driving one that no longer steps. The
    optimizer must have no state yet.
    """
    if has_stepped(optimizer):
        raise ConfigError(NOT_FRESH)
    by_name = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        group["params"] = [by_name[n] for n in group_names]
    optimizer.state.clear()
    return optimizer
