"""Loading a sharded checkpoint under any strategy and world size.

Where the optimizer the loop steps is a torch optimizer over the module's parameters
(`holder.state_by_module`), each rank builds its own layout of the state (its shards,
its stage's tensors, a whole replica) and DCP reads into it just the pieces that rank
needs, resharding from whatever layout wrote them. Elsewhere (zero1, ps) every rank reads
the whole state and loads it through `holder.load_full_state`, as from a consolidated
checkpoint. Either way the checkpoint is checked against the whole model first, from the
index alone, and a checkpoint that does not fit loads nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from dtrain.checkpoint.dcp_io import (
    MODEL,
    OPTIMIZER,
    load,
    model_entries,
    read_entries,
    read_metadata,
)
from dtrain.checkpoint.flat_optimizer import (
    GROUPS,
    STATE,
    flatten,
    needed,
    parameter_of,
    unflatten,
)
from dtrain.checkpoint.format import check_fit, expected_shapes
from dtrain.checkpoint.optimizer_state import load_by_name, parameter_names, state_by_name
from dtrain.errors import CheckpointError, DamagedCheckpointError
from dtrain.process.collectives import gather_objects

if TYPE_CHECKING:
    from dtrain.checkpoint.holder import StateHolder

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def load_sharded(
    path: Path,
    holder: StateHolder,
    optimizer: Optimizer | None,
    strict: bool,
    groups: list[list[str]] | None,
) -> tuple[list[str], bool]:
    """Load the sharded checkpoint at `path` into the holder's model (and `optimizer`);
    collective over the training ranks. `groups` are the optimizer's groups by name, from
    the trainer state. Returns (names skipped with strict=False, whether optimizer state
    was loaded)."""
    metadata = read_metadata(path)
    found = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (shape, dtype) in model_entries(metadata).items()
    }
    keys = {
        key.removeprefix(OPTIMIZER)
        for key in metadata.state_dict_metadata
        if key.startswith(OPTIMIZER)
    }
    if not keys:
        optimizer = None
    if not holder.state_by_module:
        return _load_whole(path, holder, optimizer, strict, found, groups), optimizer is not None
    skipped = _load_by_module(path, holder, optimizer, strict, found, keys)
    return skipped, optimizer is not None


def _load_whole(
    path: Path,
    holder: StateHolder,
    optimizer: Optimizer | None,
    strict: bool,
    found: dict[str, torch.Tensor],
    groups: list[list[str]] | None,
) -> list[str]:
    check_fit(expected_shapes(holder.unwrap()), found, strict)  # before reading anything
    if optimizer is not None and groups is None:
        raise DamagedCheckpointError(
            f"{path} holds optimizer state but its trainer state does not say which "
            "parameter group each parameter is in; the checkpoint is damaged. Resume from "
            "an older checkpoint."
        )
    tensors, optimizer_state = read_whole(path, groups if optimizer is not None else None)
    return holder.load_full_state(tensors, optimizer, optimizer_state, strict)


def read_whole(
    path: Path, groups: list[list[str]] | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The whole model (canonical names) and, given the optimizer's `groups` by name, the
    name-keyed optimizer state of the sharded checkpoint at `path`, read by this process
    alone."""
    settings = needed(groups) if groups is not None else None

    def keep(key: str) -> bool:
        if key.startswith(OPTIMIZER):
            return settings is not None and settings(key.removeprefix(OPTIMIZER))
        return key.startswith(MODEL)

    entries = read_entries(path, keep)
    tensors = {k.removeprefix(MODEL): v for k, v in entries.items() if k.startswith(MODEL)}
    flat = {k.removeprefix(OPTIMIZER): v for k, v in entries.items() if k.startswith(OPTIMIZER)}
    optimizer_state = unflatten(flat, groups) if flat and groups is not None else None
    return tensors, optimizer_state


def _load_by_module(
    path: Path,
    holder: StateHolder,
    optimizer: Optimizer | None,
    strict: bool,
    found: dict[str, torch.Tensor],
    keys: set[str],
) -> list[str]:
    module = holder.unwrap()
    group = holder.checkpoint_group
    whole: dict[str, torch.Size] = {}
    for part in gather_objects(expected_shapes(module), group):  # a stage knows its part
        whole.update(part)
    skipped = set(check_fit(whole, found, strict))
    model = get_model_state_dict(module)
    request = {MODEL + k: v for k, v in model.items() if k not in skipped}
    names = set(parameter_names(module).values())
    target = None
    if optimizer is not None:
        target, with_state = _optimizer_target(module, optimizer, keys, skipped)
        wanted = needed(_groups_by_name(optimizer, module))
        request.update(
            (OPTIMIZER + k, v)
            for k, v in target.items()
            if wanted(k) and parameter_of(k, names) not in skipped
        )
    # Tensors are read in place into this rank's shards; other values are replaced.
    load(request, path, group, distributed=dist.is_initialized())
    model.update((k, request[MODEL + k]) for k in model if MODEL + k in request)
    set_model_state_dict(module, model, options=StateDictOptions(strict=not skipped))
    if optimizer is not None and target is not None:
        target.update((k, request[OPTIMIZER + k]) for k in target if OPTIMIZER + k in request)
        if with_state:
            set_optimizer_state_dict(module, optimizer, target, options=FLAT)
        else:  # the groups' settings, and no state: the optimizer's own is dropped
            settings = unflatten(target, _groups_by_name(optimizer, module))
            load_by_name(optimizer, module, settings, names - skipped if skipped else None)
    return sorted(skipped)


def _optimizer_target(
    module: nn.Module, optimizer: Optimizer, keys: set[str], skipped: set[str]
) -> tuple[dict[str, Any], bool]:
    """This rank's flat optimizer entries to read, and whether they include state (a
    checkpoint written before the first step holds the groups' settings only). Raises,
    having loaded nothing, if the checkpoint's optimizer is another one."""
    names = set(parameter_names(module).values())
    settings = {
        k: v
        for k, v in flatten(state_by_name(optimizer, module, lambda _: None)).items()
        if k.startswith(GROUPS)
    }
    _check_keys(settings, keys, skipped, names)
    if not any(k.startswith(STATE) for k in keys):
        return settings, False
    # Gives every parameter's state a place to load into (an optimizer that has not
    # stepped yet takes a zero-lr step first; the step count is restored after loading).
    target = get_optimizer_state_dict(module, optimizer, options=FLAT)
    _check_keys(target, keys, skipped, names)
    return target, True


def _check_keys(wanted: dict[str, Any], keys: set[str], skipped: set[str], names: set[str]) -> None:
    missing = sorted(k for k in wanted if k not in keys and parameter_of(k, names) not in skipped)
    if missing:
        raise CheckpointError(
            "The checkpoint's optimizer state does not fit this optimizer (missing: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}); nothing was "
            "loaded. Load it with the optimizer class and parameter groups that saved it, or "
            "without an optimizer to load the model alone."
        )


def _groups_by_name(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    named = state_by_name(optimizer, module, lambda _: None)["param_groups"]
    return [group["params"] for group in named]
