"""The optimizer on both sides of the parameter server.

Servers rebuild the user's optimizer (same class, same per-group hyperparameters, as
worker 0 describes them) over their flat shard and apply it there, keeping its state in
CPU memory (MXNet KVStore's server-side updater; BytePS's "summation service" keeps the
optimizer on the workers, we follow the classic PS and keep it on the servers). A server
sees only 1-D slices of the parameters, so it can run exactly the optimizers whose update
is element-wise.

Workers hold a :class:`WorkerOptimizer`: a real `torch.optim.Optimizer` over the model's
parameters whose `step()` commits the pushed gradients with the current learning rates
and starts the pull, and whose `state_dict()` / `load_state_dict()` reach the servers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


class WorkerOptimizer(Optimizer):
    """The optimizer a worker steps: commit the gradients to the servers, then pull.

    Args:
        template: the user's optimizer (its param groups are shared).
        commit: called by `step` with the learning rate of every param group.
        fetch_state: returns the servers' optimizer state, keyed by parameter position.
    """

    def __init__(
        self,
        template: Optimizer,
        commit: Callable[[list[float]], None],
        fetch_state: Callable[[], dict[int, dict[str, Any]]],
    ) -> None:
        groups = [{**group} for group in template.param_groups]
        super().__init__(groups, template.defaults)
        # The user's own group dicts (same parameters): a learning-rate scheduler built on
        # the user's optimizer before engine.setup sets the rates this one commits.
        self.param_groups = template.param_groups
        self._commit = commit
        self._fetch_state = fetch_state
        self.loaded_state: dict[int, dict[str, Any]] | None = None
        """State given to `load_state_dict`, waiting to be sent to the servers."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Send this step's gradients for an update (the servers apply the optimizer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._commit([float(group["lr"]) for group in self.param_groups])
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
