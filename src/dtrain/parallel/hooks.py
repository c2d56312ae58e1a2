"""Gradient hooks a user put on parameters before `engine.setup`.

``p.register_hook(fn)`` and ``p.register_post_accumulate_grad_hook(fn)`` live on the tensor
object. Layouts that replace parameters by new objects (tensor-parallel DTensors, model
replicas) would drop them silently, so they are read before the model is parallelised
and registered again on the parameters that take their place. Sharded layouts (FSDP2)
reduce a gradient into its shard outside autograd, where no tensor hook runs: there the
hooks are refused by name rather than lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from dtrain.errors import ConfigError


@dataclass
class GradientHooks:
    """Each parameter's hooks, by canonical name."""

    on_grad: dict[str, list[Callable]] = field(default_factory=dict)
    """``register_hook`` functions (called with the gradient, may return a new one)."""
    after_accumulate: dict[str, list[Callable]] = field(default_factory=dict)
    """``register_post_accumulate_grad_hook`` functions (called with the parameter)."""
    holders: dict[str, int] = field(default_factory=dict)
    """The id of each hooked parameter when the hooks were read."""

    @property
    def names(self) -> list[str]:
        """The parameters that hold a hook."""
        return sorted({*self.on_grad, *self.after_accumulate})

    def refuse(self, strategy: str, why: str) -> None:
        """Raise a ConfigError naming the hooked parameters, if there are any."""
        names = self.names
        if not names:
            return
        raise ConfigError(
            f"Parameter(s) {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} carry a "
            f"gradient hook (Tensor.register_hook), which strategy {strategy} cannot keep: "
            f"{why}. Change the gradient in the loop instead, between engine.backward(loss) "
            "and optimizer.step() (`p.grad.mul_(...)` on `model.parameters()` works on any "
            "strategy for elementwise changes), or use --strategy ddp."
        )

    def register(self, model: nn.Module) -> None:
        """Register the hooks again on the parameters of `model` that replaced the hooked
        ones (same name, another object); parameters kept as they were keep their hooks."""
        for name, param in model.named_parameters():
            if name not in self.holders or id(param) == self.holders[name]:
                continue
            for hook in self.on_grad.get(name, []):
                param.register_hook(hook)
            for hook in self.after_accumulate.get(name, []):
                param.register_post_accumulate_grad_hook(hook)


def gradient_hooks(model: nn.Module) -> GradientHooks:
    """The gradient hooks on `model`'s parameters (read from the tensors themselves)."""
    found = GradientHooks()
    for name, param in model.named_parameters():
        on_grad = getattr(param, "_backward_hooks", None) or {}
        after = getattr(param, "_post_accumulate_grad_hooks", None) or {}
        if on_grad:
            found.on_grad[name] = list(on_grad.values())
        if after:
            found.after_accumulate[name] = list(after.values())
        if on_grad or after:
            found.holders[name] = id(param)
    return found
