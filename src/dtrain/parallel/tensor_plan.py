"""Tensor parallelism plans: which Linear layers split by columns and which by rows.

A model gives its plan with a ``tensor_parallel_plan(degree)`` method returning
``{module path: style}``; paths may hold ``*`` wildcards (``blocks.*.mlp.up``) and a
style is "colwise", "rowwise" or any `torch.distributed.tensor.parallel.ParallelStyle`.
A column-split layer's output channels are divided over the ranks, a row-split layer's
input channels; pairing them (colwise then rowwise) needs one all-reduce per pair.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dtrain.errors import ConfigError

STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def plan_of(model: nn.Module, degree: int) -> dict[str, ParallelStyle]:
    """`model`'s plan for `degree` ranks, checked: every path matches a module and every
    split dimension divides by `degree`."""
    method = getattr(model, "tensor_parallel_plan", None)
    if not callable(method):
        raise ConfigError(
            f"Tensor parallelism needs a plan saying which layers to split, and "
            f"{type(model).__name__} has none. Add `def tensor_parallel_plan(self, degree): "
            "return {'blocks.*.mlp.up': 'colwise', 'blocks.*.mlp.down': 'rowwise', ...}` to "
            "the model (see docs/strategies.md, tensor)."
        )
    try:
        raw = method(degree)
    except ValueError as e:
        raise ConfigError(f"--tp {degree} does not fit {type(model).__name__}: {e}.") from None
    plan: dict[str, ParallelStyle] = {}
    for path, style in raw.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise ConfigError(
                    f"Unknown tensor-parallel style {style!r} for {path}; use one of "
                    f"{', '.join(STYLES)} or a ParallelStyle object."
                )
            style = STYLES[style]()
        matches = [(n, m) for n, m in model.named_modules() if fnmatch(n, path)]
        if not matches:
            raise ConfigError(f"The tensor-parallel plan names {path!r}, which matches no module.")
        for name, module in matches:
            _check_splittable(name, module, style)
            _check_divisible(type(model).__name__, name, module, style, degree)
        plan[path] = style
    return plan


def _check_splittable(name: str, module: nn.Module, style: ParallelStyle) -> None:
    """torch's column and row styles split Linear and Embedding layers only."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(
        module, (nn.Linear, nn.Embedding)
    ):
        raise ConfigError(
            f"The tensor-parallel plan splits {name}, a {type(module).__name__}, but the "
            "colwise and rowwise styles split only nn.Linear and nn.Embedding layers. Name "
            "the Linear layers inside it instead, leave it out of the plan, or give a "
            "ParallelStyle of your own for it."
        )


def _check_divisible(
    model: str, name: str, module: nn.Module, style: ParallelStyle, degree: int
) -> None:
    if not isinstance(module, nn.Linear):
        return
    size, what = (
        (module.out_features, "output features")
        if isinstance(style, ColwiseParallel)
        else (module.in_features, "input features")
    )
    if size % degree:
        fits = [d for d in range(2, min(size, 8) + 1) if size % d == 0]
        such = f" (such as {' or '.join(map(str, fits[:3]))})" if fits else ""
        raise ConfigError(
            f"{name} has {size} {what}, which --tp {degree} cannot split evenly in "
            f"{model}'s tensor-parallel plan; pick a --tp that divides {size}{such} and the "
            "plan's other split sizes (a transformer's attention heads too), or resize the "
            "layer."
        )


def plan_within(module: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of `plan` that match a submodule of `module` (a pipeline stage holds
    only some of the layers the whole model's plan names)."""
    names = [name for name, _ in module.named_modules()]
    return {path: style for path, style in plan.items() if any(fnmatch(n, path) for n in names)}


def apply_tp(unit: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Shard the layers of `unit` (a whole model or a pipeline stage) that `plan` names over
    the tensor-parallel `mesh` (Megatron-style: Shoeybi et al. 2019)."""
    part = plan_within(unit, plan)
    if part:
        parallelize_module(unit, mesh, part)
