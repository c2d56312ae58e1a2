"""Optimizer state in the flat, name-keyed layout of sharded checkpoints.

`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` with
``flatten_optimizer_state_dict=True`` keys every value by its parameter's name:
``state.<name>.<key>`` (a nested state adds more dotted keys) and
``param_groups.<name>.<setting>``, so pipeline stages, which each hold some of the
parameters, write their parts side by side. The group a parameter belongs to is not in
that layout; sharded checkpoints record it by name in their trainer state. The same
layout is written here from the name-keyed state of `optimizer_state.state_by_name`, and
read back into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STATE = "state."
GROUPS = "param_groups."


def flatten(name_keyed: dict[str, Any]) -> dict[str, Any]:
    """`{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}` as flat keys."""
    flat: dict[str, Any] = {}

    def put(prefix: str, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                put(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = value

    for name, values in name_keyed["state"].items():
        put(f"{STATE}{name}.", values)
    for group in name_keyed["param_groups"]:
        for name in group["params"]:
            for setting, value in group.items():
                if setting != "params":
                    flat[f"{GROUPS}{name}.{setting}"] = value
    return flat


def _entries(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The values under `prefix`, keyed by the rest of their key, nested at dots."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(prefix):
            *parents, last = key[len(prefix) :].split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
    return out


def unflatten(flat: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """The name-keyed state of a flat one, given each group's parameter names in order.

    A parameter name never begins another one followed by a dot (a module's attribute is
    a parameter or a submodule, not both), so ``state.<name>.`` picks exactly its own keys.
    """
    state = {}
    for name in (n for group in groups for n in group):
        entries = _entries(flat, f"{STATE}{name}.")
        if entries:
            state[name] = entries
    param_groups = [
        {**(_entries(flat, f"{GROUPS}{group[0]}.") if group else {}), "params": list(group)}
        for group in groups
    ]
    return {"state": state, "param_groups": param_groups}


def parameter_of(key: str, names: set[str]) -> str | None:
    """The parameter (among `names`) a flat key belongs to; None if none does."""
    for section in (STATE, GROUPS):
        if key.startswith(section):
            parts = key[len(section) :].split(".")
            for end in range(len(parts) - 1, 0, -1):
                if ".".join(parts[:end]) in names:
                    return ".".join(parts[:end])
    return None


def needed(groups: list[list[str]]) -> Callable[[str], bool]:
    """Which flat keys a load reads, given the groups by name: all the state, and the
    settings of each group's first parameter only (its other parameters carry the same
    ones, and readers take the first's), which spares reading most small values."""
    firsts = {group[0] for group in groups if group}

    def wanted(key: str) -> bool:
        return key.startswith(STATE) or parameter_of(key, firsts) is not None

    return wanted


def merge_groups(parts: list[list[list[str]] | None]) -> list[list[str]] | None:
    """The optimizer's groups by name over all ranks, from each rank's own groups (a
    pipeline stage holds some parameters of each group; replicas hold the same ones)."""
    present = [part for part in parts if part is not None]
    if not present:
        return None
    merged: list[list[str]] = [[] for _ in present[0]]
    for part in present:
        for into, names in zip(merged, part, strict=True):
            into.extend(n for n in names if n not in into)
    return merged
