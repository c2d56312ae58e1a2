"""What `dtrain plan` plans for: a model, an example batch and a loss, from a bundled model
(`--model`), a factory (`--factory module:function`) or a script (`--script FILE`).

The factory contract: a function taking no arguments and returning ``(model, batch,
loss_fn)``:

- ``model``: an `nn.Module` on the CPU, as the training script builds it (with
  ``pipeline_layers()`` / ``tensor_parallel_plan(degree)`` if it offers pipeline or tensor
  parallelism);
- ``batch``: ``(inputs, targets)``, two tensors whose first dimension is the batch (any
  size from 1; the planner repeats the samples to the batch sizes it probes);
- ``loss_fn``: ``loss_fn(model(inputs), targets)`` returns the scalar loss.

``--script FILE`` names a Python file that defines such a function as ``plan_model``
(``--script FILE:NAME`` names another). Loading runs the file's top level, as `dtrain run`
would, but not its ``if __name__ == "__main__":`` block.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SCRIPT_FUNCTION = "plan_model"
"""The function `--script FILE` calls when FILE names none."""


@dataclass
class Workload:
    """A model with an example batch, its loss and the optimizer it trains with."""

    name: str
    """How the reports name it (``mlp``, ``gpt small``, ``mymodule:make``)."""
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: LossFn
    optimizer: str
    """sgd or adamw (`dtrain.models.recipes.make_optimizer`)."""
    bundled: bool
    """True for `--model`: the flags then include the demo's model flags."""
    dataset: Dataset | None = None
    """The bundled model's training set (what each step loads from); None for a user's
    model, whose steps are timed loading the example samples."""

    def batch(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`size` samples (the example's repeated as needed) on `device`."""
        have = self.inputs.shape[0]
        index = torch.arange(size) % have
        return self.inputs[index].to(device), self.targets[index].to(device)


@dataclass(frozen=True)
class Source:
    """Which workload: the flags that name it (so a helper process can load it again)."""

    model: str | None = None
    model_size: str | None = None
    script: str | None = None
    factory: str | None = None
    optimizer: str | None = None
    experts: int | None = None
    """The bundled GPT's experts per MLP (`--experts`); None for a dense model."""
    top_k: int | None = None
    """Experts each token goes to (`--top-k`), with `experts`."""

    def args(self) -> list[str]:
        """The flags, for `describe_args`."""
        return [f"{k}={v}" for k, v in vars(self).items() if v is not None]


def describe_args(words: list[str]) -> Source:
    """The Source that `Source.args` wrote (every value as text: `load_source` reads the
    numbers back)."""
    return Source(**dict(w.split("=", 1) for w in words))  # type: ignore[arg-type]


def load_source(source: Source) -> Workload:
    """The workload `source` names (the demo's default model when it names none)."""
    given = [f for f in ("model", "script", "factory") if getattr(source, f)]
    if len(given) > 1:
        raise ConfigError(
            f"Give one model: --{given[0]} and --{given[1]} were both given; pick one of "
            "--model, --script and --factory."
        )
    if source.experts and not source.model:
        raise ConfigError(
            "--experts builds the bundled GPT's mixture-of-experts MLPs (with --model gpt); a "
            "--script or --factory model brings its own experts: drop --experts."
        )
    if source.factory:
        return from_factory(source.factory, source.optimizer)
    if source.script:
        return from_script(source.script, source.optimizer)
    experts, top_k = int(source.experts or 0), int(source.top_k or 2)
    return bundled(source.model or "cnn", source.model_size, source.optimizer, experts, top_k)


def bundled(
    name: str, size: str | None, optimizer: str | None, experts: int = 0, top_k: int = 2
) -> Workload:
    """The demo's model `name` with a batch of its real training data (gpt: with
    `experts`, each block's MLP a mixture of that many experts, `top_k` per token)."""
    from dtrain.models import build
    from dtrain.models.recipes import TASKS

    model = build(name, size, experts, top_k)
    task = TASKS[name]
    train, _ = task.data(model)
    inputs, targets = train[: min(len(train), 256)]
    label = f"{name} {size or 'tiny'}" if name == "gpt" else name
    if experts:
        label += f", {experts} experts top-{top_k}"
    return Workload(
        label, model, inputs, targets, task.loss, optimizer or task.optimizer, True, train
    )


def from_factory(spec: str, optimizer: str | None) -> Workload:
    """The workload of `--factory module:function`."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ConfigError(
            f"--factory takes MODULE:FUNCTION (such as mypackage.models:make_model), got {spec!r}."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"--factory {spec}: cannot import module {module_name!r} ({e}); check the name and "
            "that it is on PYTHONPATH (run dtrain from the directory that holds it)."
        ) from None
    return _call(getattr(module, function, None), f"--factory {spec}", function, optimizer)


def from_script(spec: str, optimizer: str | None) -> Workload:
    """The workload of `--script FILE[:FUNCTION]` (FUNCTION defaults to plan_model)."""
    path_text, _, function = spec.partition(":") if spec.count(":") == 1 else (spec, "", "")
    function = function or SCRIPT_FUNCTION
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(f"--script {path_text}: no such file; give the path of a Python file.")
    loaded = importlib.util.spec_from_file_location("dtrain_plan_script", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        loaded.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return _call(getattr(module, function, None), f"--script {spec}", function, optimizer)


def _call(factory: object, where: str, function: str, optimizer: str | None) -> Workload:
    if not callable(factory):
        raise ConfigError(
            f"{where}: there is no function {function!r} to call. Define `def {function}(): "
            "return model, (inputs, targets), loss_fn` (see docs/plan.md)."
        )
    made = factory()
    shape = (
        "It must return (model, (inputs, targets), loss_fn): an nn.Module, a pair of "
        "tensors with the batch first, and loss_fn(model(inputs), targets) -> scalar."
    )
    if not (isinstance(made, tuple) and len(made) == 3):
        raise ConfigError(f"{where} returned {type(made).__name__}. {shape}")
    model, batch, loss_fn = made
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ConfigError(f"{where} returned something else than a model and a loss. {shape}")
    if not (
        isinstance(batch, (tuple, list))
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch)
        and batch[0].shape[0] == batch[1].shape[0]
    ):
        raise ConfigError(f"{where} returned a batch that is not a pair of tensors. {shape}")
    return Workload(
        where.split(" ", 1)[1], model, batch[0], batch[1], loss_fn, optimizer or "adamw", False
    )
