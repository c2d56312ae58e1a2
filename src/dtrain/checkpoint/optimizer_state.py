"""Optimizer state keyed by canonical parameter names instead of positions.

`torch.optim.Optimizer.state_dict()` numbers parameters by their order in the optimizer,
which differs between wrappings and strategies; names do not. So a checkpoint stores
``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}`` and loading maps
the names back onto whatever order the reading optimizer has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.canonical import canonical_name
from dtrain.errors import CheckpointError


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Map id(parameter) to its canonical name in `model` (first name of a shared one)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(param), canonical_name(name))
    return names


def _positions_to_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[int, str]:
    position_names: dict[int, str] = {}
    position = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointError(
                    "The optimizer holds a parameter that is not in the model; create the "
                    "optimizer from model.parameters() before engine.setup."
                )
            position_names[position] = names[id(param)]
            position += 1
    return position_names


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor | None:
    return tensor.detach().cpu()


def state_by_name(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    to_host: Callable[[torch.Tensor], torch.Tensor | None] = _to_cpu,
) -> dict[str, Any]:
    """The optimizer's state_dict with parameter positions replaced by canonical names.

    Each state tensor goes through `to_host` (default: a CPU copy), one at a time.
    """
    position_names = _positions_to_names(optimizer, parameter_names(model))
    raw = optimizer.state_dict()
    state = {
        position_names[pos]: {
            k: to_host(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()
        }
        for pos, value in raw["state"].items()
    }
    groups = [
        {**group, "params": [position_names[pos] for pos in group["params"]]}
        for group in raw["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def load_by_name(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    saved: dict[str, Any],
    only: set[str] | None = None,
) -> None:
    """Load a name-keyed optimizer state (from :func:`state_by_name`) into `optimizer`.

    With `only`, load the state of those parameters alone (a partial load, strict=False:
    the others start fresh) instead of requiring the same parameters in every group.
    """
    position_names = _positions_to_names(optimizer, parameter_names(model))
    name_positions = {name: pos for pos, name in position_names.items()}
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one "
            f"has {len(optimizer.param_groups)}; build the optimizer with the same groups as "
            "the run that saved it."
        )
    groups = []
    start = 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups, strict=True):
        positions = list(range(start, start + len(group["params"])))
        start += len(positions)
        here = {position_names[p] for p in positions}
        there = set(saved_group["params"])
        if only is None and here != there:
            diff = sorted(here ^ there)
            raise CheckpointError(
                "The checkpoint's optimizer covers other parameters than this one (differing: "
                f"{', '.join(diff[:5])}); load it into the same model and optimizer groups "
                "that saved it."
            )
        # load_state_dict pairs saved and current parameters by position, in order.
        groups.append({**saved_group, "params": positions})
    state = {
        name_positions[name]: value
        for name, value in saved["state"].items()
        if name in name_positions and (only is None or name in only)
    }
    optimizer.load_state_dict({"state": state, "param_groups": groups})
