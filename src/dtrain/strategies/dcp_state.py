"""Whole (unsharded) model and optimizer state of modules holding DTensor parameters.

FSDP2, tensor parallelism and their mixes keep parameters and optimizer state as DTensors;
`torch.distributed.checkpoint.state_dict` gathers them into whole tensors under canonical
names and scatters whole tensors back. A pipeline stage holds only some of the model's
names, so loading takes the subset the module has. An optimizer state without a tensor to
scatter (SGD without momentum, any optimizer before its first step) is loaded by name
instead: torch's scatter learns the device from the state's tensors and has none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dtrain.checkpoint.canonical import canonical_name
from dtrain.checkpoint.flat_optimizer import STATE, flatten
from dtrain.checkpoint.format import check_fit, expected_shapes
from dtrain.checkpoint.optimizer_state import load_by_name, state_by_name


def whole_state(
    module: nn.Module, optimizer: Optimizer | None, keep: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """`module`'s whole tensors and name-keyed optimizer state, gathered one tensor at a
    time (a collective over the ranks sharing its DTensors; device memory for one whole
    tensor at once) and copied to the CPU: a snapshot that training does not change, one
    tensor per name. Ranks with `keep` False take part but keep nothing."""

    def whole(tensor: torch.Tensor) -> torch.Tensor | None:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if not keep:
            return None
        # Always a copy: on the CPU `.cpu()` would hand back the live tensor (a replicated
        # DTensor's too), so the state would change with training and tied weights would
        # reach the writer as one tensor under two names.
        return tensor.detach().to("cpu", copy=True).contiguous()

    tensors = {canonical_name(k): whole(v) for k, v in module.state_dict().items()}
    optimizer_state = state_by_name(optimizer, module, whole) if optimizer is not None else None
    return tensors, optimizer_state  # type: ignore[return-value]


def restrict(optimizer_state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The part of a name-keyed optimizer state that concerns parameters in `names`."""
    return {
        "state": {k: v for k, v in optimizer_state["state"].items() if k in names},
        "param_groups": [
            {**group, "params": [n for n in group["params"] if n in names]}
            for group in optimizer_state["param_groups"]
        ],
    }


def load_full_state(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    optimizer: Optimizer | None,
    optimizer_state: dict[str, Any] | None,
    strict: bool,
    whole_model: dict[str, torch.Size] | None = None,
) -> list[str]:
    """Scatter whole `tensors` (and optimizer state) into `module`'s DTensors.

    `whole_model` gives the whole model's shapes when `module` holds a part of it (a
    pipeline stage): the checkpoint is checked against the whole, then the part loaded.
    Returns the names skipped with strict=False.
    """
    here = expected_shapes(module)
    skipped = check_fit(whole_model or here, tensors, strict)
    usable = {k: v for k, v in tensors.items() if k in here and k not in skipped}
    options = StateDictOptions(full_state_dict=True, strict=not skipped)
    set_model_state_dict(module, usable, options=options)
    if optimizer is not None and optimizer_state is not None:
        names = {n for n, _ in module.named_parameters()} - set(skipped)
        part = restrict(optimizer_state, names) if whole_model or skipped else optimizer_state
        if _has_tensors_to_scatter(part):
            set_optimizer_state_dict(module, optimizer, part, options=options)
        else:
            load_by_name(optimizer, module, part, names if skipped else None)
    return skipped


def _has_tensors_to_scatter(optimizer_state: dict[str, Any]) -> bool:
    """Whether a name-keyed optimizer state holds a tensor of at least one dimension (a
    momentum, a moment): what `set_optimizer_state_dict` needs to place the state. Step
    counts are 0-dimensional, the same on every rank."""
    return any(
        isinstance(value, torch.Tensor) and value.dim() > 0
        for key, value in flatten(optimizer_state).items()
        if key.startswith(STATE)
    )


def merge_parts(
    parts: list[tuple[dict[str, torch.Tensor], dict[str, Any] | None]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The whole model and optimizer state from the stages' parts."""
    tensors = {k: v for part, _ in parts for k, v in part.items()}
    states = [state for _, state in parts if state is not None]
    if not states:
        return tensors, None
    groups = [dict(group, params=[]) for group in states[0]["param_groups"]]
    for state in states:
        for merged, group in zip(groups, state["param_groups"], strict=True):
            # A tied weight's state comes from each stage holding it: keep one.
            merged["params"] += [n for n in group["params"] if n not in merged["params"]]
    return tensors, {
        "state": {k: v for s in states for k, v in s["state"].items()},
        "param_groups": groups,
    }
