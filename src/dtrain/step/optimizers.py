"""Which optimizers a strategy can run: those whose state is per parameter can be split
(sharded state, sharded or pipelined parameters); one that keeps state over the whole model
and re-evaluates it through a closure (L-BFGS: its step needs one) runs only where every
rank steps the whole model, in a loop written by hand."""

from __future__ import annotations

import inspect

from torch.optim import Optimizer

from dtrain.errors import ConfigError, SetupError

WHOLE_MODEL_STRATEGIES = ("single", "towers", "ddp")
"""The strategies whose optimizer steps every parameter of the model, unsplit."""


def needs_closure(optimizer: Optimizer) -> bool:
    """True if `optimizer.step` cannot run without a closure that re-evaluates the loss."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_split(optimizer: Optimizer, strategy: str, splits: bool) -> None:
    """Refuse a whole-model optimizer under a strategy that splits the model (`splits`)."""
    if splits and needs_closure(optimizer):
        raise ConfigError(
            f"{type(optimizer).__name__} keeps its state over the whole model, so it cannot be "
            f"split over ranks as strategy {strategy} splits the parameters or their state. "
            f"Run it under {', '.join(WHOLE_MODEL_STRATEGIES)}, or choose an optimizer whose "
            "state is per parameter (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, ...)."
        )


def train_step_refusal(optimizer: Optimizer) -> SetupError | None:
    """Why `engine.train_step` cannot step `optimizer` (its step needs a closure), or None."""
    if needs_closure(optimizer):
        name = type(optimizer).__name__
        return SetupError(
            f"{name}.step needs a closure that re-evaluates the loss, and engine.train_step "
            "steps once without one. Write the loop by hand: def closure(): "
            "optimizer.zero_grad(); loss = loss_fn(model(x), y); engine.backward(loss); "
            f"return loss; then optimizer.step(closure) (under "
            f"{', '.join(WHOLE_MODEL_STRATEGIES)})."
        )
    return None
