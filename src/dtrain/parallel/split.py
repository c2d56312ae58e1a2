"""Cut a model into pipeline stages: which layers, how balanced, under which names.

A model can be split when its forward is a chain of layers: an `nn.Sequential`, any
module with a ``pipeline_layers()`` method returning ``[(name, module), ...]`` such that
``model(x)`` equals applying the modules in order (names are the modules' qualified
names in the model, so checkpoints keep their canonical names), a Hugging Face causal
LM whose config carries a pipeline plan (`dtrain.parallel.hf_pipeline`), or one of
torchtitan's decoders (`dtrain.parallel.titan_pipeline`). The bundled GPT has a
``pipeline_layers()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.checkpoint.optimizer_state import parameter_names
from dtrain.errors import ConfigError
from dtrain.parallel.hf_pipeline import has_pp_plan, hf_layers
from dtrain.parallel.titan_pipeline import is_titan_decoder, titan_layers

Layer = tuple[str, nn.Module]


def from_pp_plan(model: nn.Module) -> bool:
    """True if `model`'s chain is read from its Hugging Face pipeline plan (it has no chain
    of its own: neither an `nn.Sequential` nor a ``pipeline_layers()``)."""
    own = isinstance(model, nn.Sequential) or callable(getattr(model, "pipeline_layers", None))
    return not own and has_pp_plan(model)


def layers_of(model: nn.Module) -> list[Layer]:
    """The chain of layers whose composition is `model`'s forward."""
    if isinstance(model, nn.Sequential):
        chain = list(model.named_children())
    elif callable(getattr(model, "pipeline_layers", None)):
        chain = list(model.pipeline_layers())  # type: ignore[operator]
    elif from_pp_plan(model):
        chain = hf_layers(model)
    elif is_titan_decoder(model):
        chain = titan_layers(model)
    else:
        raise ConfigError(
            f"Pipeline parallelism cuts a model into a chain of layers, but "
            f"{type(model).__name__} is neither an nn.Sequential nor has a pipeline_layers() "
            "method (nor is it a Hugging Face model with a pipeline plan, or a torchtitan "
            "decoder). Add `def "
            "pipeline_layers(self): return [(name, module), ...]` listing, in forward "
            "order, submodules whose composition is the forward (see the bundled GPT and "
            "docs/strategies.md)."
        )
    covered = {id(p) for _, layer in chain for p in layer.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ConfigError(
            f"The pipeline layers of {type(model).__name__} leave out parameter(s) "
            f"{', '.join(missing[:5])}; every parameter must belong to one listed layer."
        )
    return chain


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Start index of each of `stages` contiguous groups of `costs`, minimising the largest
    group's total (the slowest stage sets the pipeline's pace)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest possible largest total when the first i layers form s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def split_layers(
    chain: list[Layer], stages: int, split_points: list[str] | None
) -> list[list[Layer]]:
    """`chain` cut into `stages` groups: at `split_points` (names of the layers that begin a
    stage), or balanced by parameter count."""
    names = [name for name, _ in chain]
    if stages > len(chain):
        raise ConfigError(
            f"{stages} pipeline stages need at least {stages} layers, but the model has "
            f"{len(chain)} ({', '.join(names)}); use fewer stages (--pp, or --virtual-stages) "
            "or a deeper model."
        )
    if split_points:
        unknown = [p for p in split_points if p not in names]
        if unknown:
            raise ConfigError(
                f"--split-points {', '.join(unknown)} name no layer; the layers are "
                f"{', '.join(names)}."
            )
        if len(split_points) != stages - 1:
            raise ConfigError(
                f"{stages} stages need {stages - 1} split point(s), got {len(split_points)} "
                f"({', '.join(split_points)})."
            )
        starts = [0, *sorted(names.index(p) for p in split_points)]
        if len(set(starts)) != stages or 0 in starts[1:]:
            raise ConfigError(
                "--split-points must name distinct layers after the first; got "
                f"{', '.join(split_points)}."
            )
    else:
        costs = [sum(p.numel() for p in layer.parameters()) or 1 for _, layer in chain]
        starts = partition(costs, stages)
    ends = [*starts[1:], len(chain)]
    return [chain[a:b] for a, b in zip(starts, ends, strict=True)]


def placements(model: nn.Module, layers: list[Layer]) -> list[Layer]:
    """(path in `model`, module) of each module a stage running `layers` holds: a layer
    under its listed name where the model holds it there, and every other module of the
    model the layers reach (a wrapper's submodules) under its first path in the model,
    outermost first, so the stage's names are the model's whatever wrappers the layers
    are."""
    at = dict(model.named_modules(remove_duplicate=False))
    reached = {id(m) for _, layer in layers for m in layer.modules()}
    placed: list[Layer] = []
    covered: set[int] = set()

    def place(path: str, module: nn.Module) -> None:
        placed.append((path, module))
        covered.update(id(m) for m in module.modules())

    for name, layer in layers:
        if at.get(name) is layer:
            place(name, layer)
    for path, module in model.named_modules():  # parents before their children
        if path and id(module) in reached and id(module) not in covered:
            place(path, module)
    return placed


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


@dataclass
class StageLayout:
    """What a :class:`Stage` runs and where it holds the model's tensors.

    Kept in one attribute with dtrain's prefix (read it with :func:`layout_of`) rather than
    in attributes of the stage: a stage hosts the model's modules under their own names,
    and no name a model may use (``layers``, ``paths``, ...) may already be taken there.
    """

    layers: list[Layer]
    """(name, module) of each layer, in forward order."""
    paths: list[str]
    """Where the stage holds the model's modules (its blocks for data parallelism)."""
    model_names: dict[str, str]
    """Stage name -> model name of the parameters the model names otherwise (the second
    name of a tied weight: ``lm_head.weight`` for ``wte.weight``)."""
    roots: list[tuple[nn.Module, str, str]]
    """(module of a layer, its attribute, the model's name) of each tensor that the model
    holds at its root and a layer registered as its own (torchtitan's ``freqs_cis``)."""
    model: nn.Module | None
    """The model the stage was cut from, where it has `roots`: its root tensors follow
    the stage's moves."""

    @property
    def layer_names(self) -> list[str]:
        """The layers' names, in forward order."""
        return [name for name, _ in self.layers]


class Stage(nn.Module):
    """Some layers of a chain, run in order, holding the model's modules they use under
    their paths in the whole model.

    Its ``state_dict`` therefore uses the canonical names: a stage holding ``blocks.3``
    has parameters ``blocks.3.attn.q.weight``, as the unsplit model does, and a stage
    whose layer is a wrapper ``_Embed(model.wte, model.wpe)`` holds ``wte.weight`` and
    ``wpe.weight``. A tensor the model holds at its root that a wrapper registered as its
    own (a rotary table: ``self.register_buffer("freqs_cis", model.freqs_cis)``) is held
    under the model's name, and the wrapper is handed the stage's tensor whenever the
    stage is moved or cast. Without `model`, the layers' names are taken as their paths.
    The stage has no attribute of its own besides ``_dtrain_layout`` (:func:`layout_of`).
    """

    def __init__(self, layers: list[Layer], model: nn.Module | None = None) -> None:
        super().__init__()
        paths: list[str] = []
        for path, module in placements(model, layers) if model is not None else layers:
            paths.append(path)
            parent: nn.Module = self
            *steps, leaf = path.split(".")
            for part in steps:
                children = dict(parent.named_children())
                if part not in children:
                    parent.add_module(part, nn.Module())
                parent = parent.get_submodule(part)
            parent.add_module(leaf, module)
        roots = _root_tensors(model, layers) if model is not None else []
        saved = set(model.state_dict(keep_vars=True)) if roots else set()
        for name in dict.fromkeys(name for _, _, name in roots):  # once each, in order
            self.register_buffer(name, getattr(model, name), persistent=name in saved)
        first = parameter_names(model) if model is not None else {}
        model_names = {
            name: first[id(p)]
            for name, p in self.named_parameters()
            if first.get(id(p), name) != name
        }
        owner = model if roots else None
        self._dtrain_layout = StageLayout(list(layers), paths, model_names, roots, owner)

    def _apply(self, fn: Any, recurse: bool = True) -> Stage:
        # Moving or casting the stage (`to`, `to_empty`, ...: all of them run `_apply`,
        # torch's one seam for it) puts new tensors in place of its buffers; the wrappers
        # that registered a root tensor of the model (not modules of the stage) and the
        # model's root are handed the stage's, so the forward reads what the stage holds.
        super()._apply(fn, recurse)
        layout = self._dtrain_layout
        for module, attribute, name in layout.roots:
            setattr(module, attribute, getattr(self, name))
            if layout.model is not None:
                setattr(layout.model, name, getattr(self, name))
        return self

    def forward(self, x: torch.Tensor, **extras: Any) -> torch.Tensor:
        """Apply the layers in order, each given `extras` too where there are any (what
        every stage is given besides the activation: a dict batch's attention mask).
        What travels between stages is made contiguous, as gloo and NCCL send nothing
        else: the output, and the gradient of the input (a layer may well end or begin on
        a view, ``h.transpose(1, 2)``)."""
        if x.requires_grad:  # an activation from the stage before
            x = _ContiguousGrad.apply(x)
        for _, layer in self._dtrain_layout.layers:
            x = layer(x, **extras) if extras else layer(x)
        return x.contiguous()


def layout_of(stage: Stage) -> StageLayout:
    """What `stage` runs and where it holds the model's tensors."""
    return stage._dtrain_layout


def joined(stages: list[Stage], model: nn.Module) -> Stage:
    """One stage holding the layers of `stages`, in order (a rank's part, for its
    optimizer and checkpoints), whose tied weights keep the model's names they had when
    the stages were cut: tensor parallelism gives a stage's copy of a tied weight a
    parameter of its own, and the model no longer knows the two as one."""
    whole = Stage([layer for stage in stages for layer in layout_of(stage).layers], model)
    names = dict(whole.named_parameters())
    layout_of(whole).model_names.update(
        (name, model_name)
        for stage in stages
        for name, model_name in layout_of(stage).model_names.items()
        if name in names
    )
    return whole


def _root_tensors(model: nn.Module, layers: list[Layer]) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, the model's name) of each tensor the model holds at its root
    that a module of the layers outside the model (a wrapper) holds as its own."""
    root = {
        id(t): name
        for name, t in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]
    }
    inside = {id(m) for m in model.modules()}
    found: list[tuple[nn.Module, str, str]] = []
    for _, layer in layers:
        for module in layer.modules():
            if id(module) in inside:
                continue
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            found += [(module, attr, root[id(t)]) for attr, t in own if id(t) in root]
    trained = {id(p) for p in model.parameters(recurse=False)}
    held = [name for module, attr, name in found if id(getattr(module, attr)) in trained]
    if held:
        raise ConfigError(
            f"A layer of {type(model).__name__}.pipeline_layers() holds the model's root "
            f"parameter(s) {', '.join(dict.fromkeys(held))} as its own; data and tensor "
            "parallelism put new parameter objects in the stage's place, which such a layer "
            "would not see, and its forward would read a stale copy. Hold the parameter in a "
            "submodule of the model (a small nn.Module owning it, as an embedding does) and "
            "give the layer that submodule."
        )
    return found


def held_names(module: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    """Of each group of the model's parameter names, those `module` holds, under the names
    it holds them by (a stage may hold a tied weight under its second name)."""
    held = {n: n for n, _ in module.named_parameters()}
    if isinstance(module, Stage):
        held |= {model_name: n for n, model_name in layout_of(module).model_names.items()}
    return [[held[n] for n in group if n in held] for group in groups]


def rename_state(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A name-keyed optimizer state with the names in `names` replaced by their values."""
    return {
        "state": {names.get(k, k): v for k, v in state["state"].items()},
        "param_groups": [
            {**group, "params": [names.get(n, n) for n in group["params"]]}
            for group in state["param_groups"]
        ],
    }
