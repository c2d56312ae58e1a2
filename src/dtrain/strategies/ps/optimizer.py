"""The optimizer on both sides of the parameter server.

Servers rebuild the user's optimizer (same class, same per-group hyperparameters, as
worker 0 describes them) over their flat shard and apply it there, keeping its state in
CPU memory (MXNet KVStore's server-side updater; BytePS's "summation service" keeps the
optimizer on the workers, we follow the classic PS and keep it on the servers). A server
sees only 1-D slices of the parameters, so it can run exactly the optimizers whose update
is element-wise.

Workers hold a :class:`WorkerOptimizer`: a real `torch.optim.Optimizer` over the model's
parameters whose `step()` commits the gradients with every param group's current numeric
settings (:class:`GroupSettings`) and starts the pull, and whose `state_dict()` /
`load_state_dict()` reach the servers.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.optim import Optimizer

from dtrain.errors import ConfigError
from dtrain.strategies.rebuild import hyperparameters

ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
BY_NAME = {cls.__name__: cls for cls in ELEMENTWISE}
"""The classes by name, as worker 0 describes its optimizer to the servers (it checked
the class with :func:`check_optimizer` first)."""


def check_optimizer(optimizer: Optimizer | None) -> None:
    """Refuse an optimizer the servers cannot run on flat slices of the parameters."""
    if optimizer is None:
        raise ConfigError(
            "--strategy ps needs an optimizer: the servers apply it. Pass it to "
            "engine.setup(model, optimizer)."
        )
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise ConfigError(
            f"The parameter servers cannot run {type(optimizer).__name__}: each server holds "
            "flat slices of the parameters, so it runs only the torch.optim optimizers whose "
            f"update is element-wise ({names}). Use one of those, or --strategy ddp."
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _width(value: Any) -> int:
    """How many floats carry `value`: 1 for a number (a 0-d tensor too), n for a tuple or
    list of n numbers, 0 for anything else (None, a string), which cannot travel."""
    if _is_number(value):
        return 1
    if isinstance(value, tuple | list) and value and all(map(_is_number, value)):
        return len(value)
    return 0


def _floats(value: Any) -> list[float]:
    """A setting of non-zero `_width` as its floats."""
    return [float(v) for v in value] if isinstance(value, tuple | list) else [float(value)]


def _as(original: Any, value: float) -> Any:
    """`value` in the type of the setting `original` held at setup (bools stay bools, ints
    ints; a tensor learning rate arrives as a float, which every optimizer takes)."""
    if isinstance(original, bool):
        return bool(value)
    if isinstance(original, int):
        return int(value)
    return value


class GroupSettings:
    """Every param group's numeric settings as one list of floats: what a COMMIT carries,
    so that the servers step with the values the worker's optimizer holds at that step (a
    scheduler sets `lr`; OneCycleLR and CyclicLR also cycle SGD's `momentum` or Adam's
    `betas`; a script may set `weight_decay`).

    The layout is worker 0's description at setup (the same on every rank). A setting that
    is not a number cannot travel in the float header: it must keep its setup value. Keys
    added to a group after setup (a scheduler's `initial_lr`, `max_lr`) do not travel: a
    torch.optim class reads only the settings its constructor filled into every group.

    Args:
        settings: each param group's settings at setup (without its parameters).
    """

    def __init__(self, settings: list[dict[str, Any]]) -> None:
        self.settings = settings
        self.carried = [[(k, _width(v)) for k, v in g.items() if _width(v)] for g in settings]
        """Each group's settings that travel, with their number of floats."""
        self.fixed = [{k: v for k, v in g.items() if not _width(v)} for g in settings]
        """Each group's settings that must keep their setup value."""
        self.width = sum(width for group in self.carried for _, width in group)
        """Floats per commit."""

    def encode(self, groups: list[dict[str, Any]]) -> list[float]:
        """The numeric settings of `groups` (the worker's param groups now), in layout order.

        Raises:
            ConfigError: a group was added, or a setting that cannot travel changed, since
                setup.
        """
        if len(groups) != len(self.settings):
            raise ConfigError(
                f"The optimizer has {len(groups)} param groups, but had {len(self.settings)} "
                "at engine.setup, when --strategy ps built it on the servers; add every "
                "param group before engine.setup."
            )
        values: list[float] = []
        for index, (group, carried, fixed) in enumerate(
            zip(groups, self.carried, self.fixed, strict=True)
        ):
            for key, width in carried:
                value = group.get(key)
                if _width(value) != width:
                    self._refuse(index, key, value)
                values.extend(_floats(value))
            for key, value in fixed.items():
                if key not in group or (group[key] is not value and group[key] != value):
                    self._refuse(index, key, group.get(key))
        return values

    def _refuse(self, index: int, key: str, value: Any) -> NoReturn:
        was = self.settings[index].get(key)
        raise ConfigError(
            f"Param group {index}'s setting {key!r} is now {value!r}, but was {was!r} at "
            "engine.setup; under --strategy ps only numbers (and tuples of numbers of the "
            "same length, such as betas) travel to the servers with each step. Give "
            f"{key!r} its final value before engine.setup."
        )

    def decode(self, values: list[float]) -> list[dict[str, Any]]:
        """Each group's numeric settings from `encode`'s `values`, in their setup types."""
        groups: list[dict[str, Any]] = []
        position = 0
        for group, carried in zip(self.settings, self.carried, strict=True):
            decoded: dict[str, Any] = {}
            for key, width in carried:
                original, part = group[key], values[position : position + width]
                if isinstance(original, tuple | list):
                    decoded[key] = type(original)(map(_as, original, part))
                else:
                    decoded[key] = _as(original, part[0])
                position += width
            groups.append(decoded)
        return groups


class WorkerOptimizer(Optimizer):
    """The optimizer a worker steps: commit the gradients to the servers, then pull.

    Args:
        template: the user's optimizer (its param groups are shared).
        settings: the layout of the param groups' numeric settings.
        commit: called by `step` with those settings, encoded.
        fetch_state: returns the servers' optimizer state, keyed by parameter position.
    """

    def __init__(
        self,
        template: Optimizer,
        settings: GroupSettings,
        commit: Callable[[list[float]], None],
        fetch_state: Callable[[], dict[int, dict[str, Any]]],
    ) -> None:
        groups = [{**group} for group in template.param_groups]
        super().__init__(groups, template.defaults)
        # The user's own group dicts (same parameters): a scheduler built on the user's
        # optimizer before engine.setup sets the values this one commits.
        self.param_groups = template.param_groups
        self._settings = settings
        self._commit = commit
        self._fetch_state = fetch_state
        self.loaded_state: dict[int, dict[str, Any]] | None = None
        """State given to `load_state_dict`, waiting to be sent to the servers."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Send this step's gradients for an update (the servers apply the optimizer with
        every param group's settings as they are now)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._commit(self._settings.encode(self.param_groups))
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The servers' optimizer state in `torch.optim` form (positions, groups)."""
        position = 0
        groups = []
        for group in self.param_groups:
            count = len(group["params"])
            groups.append(
                {**hyperparameters(group), "params": list(range(position, position + count))}
            )
            position += count
        return {"state": self._fetch_state(), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Keep the state for the servers (sent by the strategy's `after_load`)."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(hyperparameters(saved))
        self.loaded_state = {int(k): v for k, v in state_dict["state"].items()}
