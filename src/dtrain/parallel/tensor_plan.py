"""Tensor parallelism plans: which layers split by columns and which by rows.

A model gives its plan with a ``tensor_parallel_plan(degree)`` method returning
``{module path: style}``; paths may hold ``*`` wildcards (``blocks.*.mlp.up``). A Hugging
Face model without one uses the plan its config declares (`dtrain.parallel.hf_tensor_plan`).
A style is a name below or any `torch.distributed.tensor.parallel.ParallelStyle`.
A column-split layer's output channels are divided over the ranks, a row-split layer's
input channels; pairing them (colwise then rowwise) needs one all-reduce per pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dtrain.errors import ConfigError
from dtrain.parallel.hf_tensor_plan import declared_plan
from dtrain.parallel.packed import PackedColwiseParallel

STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # Hugging Face's names (transformers' ALL_PARALLEL_STYLES) for splits torch's styles make.
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),  # output gathered
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),  # input cut locally
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # An nn.Embedding split over its vocabulary (the ranks' lookups are summed) or over
    # its embedding channels (gathered).
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicate": lambda: None,  # whole on every rank, as a layer the plan leaves out
}
"""The styles a plan may name, besides ``packed_colwise:N`` (`dtrain.parallel.packed`)."""

PACKED = "packed_colwise"

REFUSED: dict[str, str] = {
    "packed_rowwise": "splits a weight packed along its input features (fused experts)",
    "sequence_parallel": (
        "splits activations along the sequence, which needs every layer around it to hand "
        "over sequence shards"
    ),
    "replicated_with_grad_allreduce": (
        "keeps a layer whole whose gradient each rank computes from its own heads only "
        "(per-head norms), which needs a gradient all-reduce dtrain does not add"
    ),
    "moe_tp_experts": "splits fused mixture-of-experts layers",
    "moe_identity_expert": "divides an identity expert's input for a split experts layer",
    "mla_kv_a_proj": "sums over the ranks the gradient of part of a latent-attention key layer",
    "all_reduce": "sums partial outputs that another layer's style leaves unreduced",
    "local_params": "runs a layer on local slices of parameters split elsewhere",
    **dict.fromkeys(
        ("local_colwise", "local_rowwise", "local_packed_rowwise", "local", "gather"),
        "keeps parameters as local slices and leaves the reduction to another layer's style",
    ),
}
"""Hugging Face style names dtrain does not apply, each with what the style does."""


@dataclass(frozen=True)
class _Origin:
    """Where a plan came from, for messages."""

    what: str
    declared: bool
    """Declared by a Hugging Face config, not written for the model."""

    @property
    def subject(self) -> str:
        """`what`, to open a sentence."""
        return self.what[0].upper() + self.what[1:]

    @property
    def fix(self) -> str:
        """The way out a declared plan always has, as a sentence to append."""
        if not self.declared:
            return ""
        return (
            " Or give the model a tensor_parallel_plan(degree) method of your own, which "
            "dtrain uses instead (docs/strategies.md, tensor)."
        )


def plan_of(model: nn.Module, degree: int) -> dict[str, ParallelStyle]:
    """`model`'s plan for `degree` ranks: its own ``tensor_parallel_plan(degree)``, else the
    one its Hugging Face config declares; checked: every path matches a module, every
    split dimension divides by `degree`, and a weight tied between layers is split alike
    by all of them."""
    cls = type(model).__name__
    raw, origin = _given_plan(model, degree)
    # Every name first: a style dtrain refuses is reported before any path.
    styles = {p: _style(s, p, origin) if isinstance(s, str) else s for p, s in raw.items()}
    plan: dict[str, ParallelStyle] = {}
    for path, style in styles.items():
        if style is None:
            continue
        matches = [(n, m) for n, m in model.named_modules() if fnmatch(n, path)]
        if not matches:
            raise ConfigError(
                f"{origin.subject} names {path!r}, which matches no "
                f"module; name a module path of {cls} (model.named_modules()).{origin.fix}"
            )
        for name, module in matches:
            _check_splittable(name, module, style, origin)
            _check_divisible(origin, name, module, style, degree)
        plan[path] = style
    _check_ties(model, plan, origin)
    return plan


def _given_plan(model: nn.Module, degree: int) -> tuple[dict[str, str | ParallelStyle], _Origin]:
    """The model's own plan, else the one its Hugging Face config declares."""
    cls = type(model).__name__
    method = getattr(model, "tensor_parallel_plan", None)
    if callable(method):
        try:
            return method(degree), _Origin(f"{cls}'s tensor-parallel plan", declared=False)
        except ValueError as e:
            raise ConfigError(f"--tp {degree} does not fit {cls}: {e}.") from None
    declared = declared_plan(model, degree)
    if declared is None:
        raise ConfigError(
            f"Tensor parallelism needs a plan saying which layers to split, and {cls} has none "
            "(no tensor_parallel_plan method, and no base_model_tp_plan in a Hugging Face "
            "config). Add `def tensor_parallel_plan(self, degree): return {'blocks.*.mlp.up': "
            "'colwise', 'blocks.*.mlp.down': 'rowwise', ...}` to the model (see "
            "docs/strategies.md, tensor)."
        )
    what = f"the tensor-parallel plan of {cls}'s Hugging Face config (base_model_tp_plan)"
    return declared, _Origin(what, declared=True)


def _style(name: str, path: str, origin: _Origin) -> ParallelStyle | None:
    """The style a plan names for `path` (None: left whole)."""
    if name in STYLES:
        return STYLES[name]()
    if name.partition(":")[0] == PACKED:
        count = name.partition(":")[2]
        if not count.isdigit() or int(count) < 2:
            raise ConfigError(
                f"{origin.subject} gives {path} the style {name!r}, "
                "but packed_colwise needs the number of parts the layer's output stacks (2 or "
                "more): write 'packed_colwise:3' for a fused [q; k; v] projection or "
                "'packed_colwise:2' for a fused [gate; up] one."
            )
        return PackedColwiseParallel(int(count))
    if name in REFUSED:
        fix = (
            "Write a tensor_parallel_plan(degree) method for the model that splits only the "
            "layers dtrain can (colwise, rowwise, packed_colwise:N, ...), such as the "
            "attention and MLP projections, or train this model under a data-parallel "
            "strategy (zero3)."
            if origin.declared
            else f"Leave {path} out of the plan or give it a style dtrain applies (colwise, "
            "rowwise, packed_colwise:N, ..., or a ParallelStyle object)."
        )
        raise ConfigError(
            f"{origin.subject} gives {path} the style {name!r}, which dtrain's tensor "
            f"parallelism does not apply: it {REFUSED[name]}. {fix}"
        )
    names = ", ".join([*STYLES, f"{PACKED}:N"])
    raise ConfigError(
        f"Unknown tensor-parallel style {name!r} for {path} in {origin.what}; use one of "
        f"{names} or a ParallelStyle object.{origin.fix}"
    )


def _check_splittable(name: str, module: nn.Module, style: ParallelStyle, origin: _Origin) -> None:
    """torch's column and row styles split Linear and Embedding layers only; a packed split
    computes with nn.Linear's forward, so it takes exactly that class."""
    if isinstance(style, PackedColwiseParallel) and type(module) is not nn.Linear:
        raise ConfigError(
            f"{origin.subject} splits {name}, a "
            f"{type(module).__name__}, with packed_colwise, which splits a plain nn.Linear "
            "whose output rows stack the parts. Split the layers inside it instead, or leave "
            f"it out of the plan.{origin.fix}"
        )
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(
        module, (nn.Linear, nn.Embedding)
    ):
        raise ConfigError(
            f"The tensor-parallel plan splits {name}, a {type(module).__name__}, but the "
            "colwise and rowwise styles split only nn.Linear and nn.Embedding layers. Name "
            "the Linear layers inside it instead, leave it out of the plan, or give a "
            f"ParallelStyle of your own for it.{origin.fix}"
        )


def _check_divisible(
    origin: _Origin, name: str, module: nn.Module, style: ParallelStyle, degree: int
) -> None:
    if not isinstance(module, nn.Linear):
        return
    colwise = isinstance(style, ColwiseParallel)
    size, what = (
        (module.out_features, "output features")
        if colwise
        else (module.in_features, "input features")
    )
    parts = style.parts if isinstance(style, PackedColwiseParallel) else 1
    if size % parts:
        raise ConfigError(
            f"{name} has {size} output features, which cannot hold the {parts} equal parts "
            f"that packed_colwise:{parts} in {origin.what} names; give the number of parts "
            f"the layer's output stacks.{origin.fix}"
        )
    if (size // parts) % degree:
        part = size // parts
        fits = [d for d in range(2, min(part, 8) + 1) if part % d == 0]
        such = f" (such as {' or '.join(map(str, fits[:3]))})" if fits else ""
        each = f" in {parts} packed parts of {part}" if parts > 1 else ""
        raise ConfigError(
            f"{name} has {size} {what}{each}, which --tp {degree} cannot split evenly in "
            f"{origin.what}; pick a --tp that divides {part}{such} and the plan's other split "
            "sizes (a transformer's attention heads too), or resize the layer."
            f"{origin.fix}"
        )


Holder = tuple[str, nn.Module, str]
"""(module path, module, parameter name) of one layer holding a parameter."""


def tied_holders(model: nn.Module) -> list[list[Holder]]:
    """The parameters held by more than one layer (``head.weight = embed.weight``), each as
    its holders, first path first."""
    holders: dict[int, list[Holder]] = {}
    seen: set[tuple[int, str]] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            if (id(module), pname) not in seen:  # a module reached by two paths holds once
                seen.add((id(module), pname))
                holders.setdefault(id(param), []).append((path, module, pname))
    return [group for group in holders.values() if len(group) > 1]


def _placement(style: ParallelStyle | None, module: nn.Module, pname: str) -> Placement | None:
    """How `style` lays out `module`'s parameter `pname` (Replicate when unsplit; None for
    a style dtrain cannot read)."""
    embedding = isinstance(module, nn.Embedding)
    if style is None:
        return Replicate()
    if isinstance(style, ColwiseParallel):
        return Shard(1) if embedding else Shard(0)
    if isinstance(style, RowwiseParallel):
        return Shard(0) if embedding else Replicate() if pname == "bias" else Shard(1)
    return None


def _check_ties(model: nn.Module, plan: dict[str, ParallelStyle], origin: _Origin) -> None:
    """A tied weight stays one tensor (apply_tp ties the split copies again) only if every
    layer holding it lays it out alike: split the same way by all, or by none."""
    for group in tied_holders(model):
        styles = [
            next((s for p, s in plan.items() if fnmatch(path, p)), None) for path, _, _ in group
        ]
        if all(s is None for s in styles):
            continue
        layouts = {_placement(s, m, pname) for s, (_, m, pname) in zip(styles, group, strict=True)}
        if len(layouts) == 1 and None not in layouts:
            continue
        names = " and ".join(f"{path}.{pname}" for path, _, pname in group)
        raise ConfigError(
            f"{names} are one tied weight, and {origin.what} splits the layers holding it "
            "differently (or one of them with a style whose layout dtrain cannot read), which "
            "would untie them. Split them alike (an embedding 'embedding_rowwise' with its "
            "output head 'colwise' or 'colwise_gather_output': both split the vocabulary) or "
            f"leave all of them out of the plan.{origin.fix}"
        )


def plan_within(module: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of `plan` that match a submodule of `module` (a pipeline stage holds
    only some of the layers the whole model's plan names)."""
    names = [name for name, _ in module.named_modules()]
    return {path: style for path, style in plan.items() if any(fnmatch(n, path) for n in names)}


def apply_tp(unit: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Shard the layers of `unit` (a whole model or a pipeline stage) that `plan` names over
    the tensor-parallel `mesh` (Megatron-style: Shoeybi et al. 2019). Each split layer gets
    a parameter of its own: a weight tied between layers (split alike, `plan_of`) is tied
    again, so it trains as one tensor as in one process."""
    part = plan_within(unit, plan)
    if not part:
        return
    ties = tied_holders(unit)
    parallelize_module(unit, mesh, part)
    for (_, first, name), *others in ties:
        for _, module, pname in others:
            setattr(module, pname, getattr(first, name))
