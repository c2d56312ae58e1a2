"""Which submodules are a model's repeated blocks (the units to shard, prefetch or split).

Transformer layers held in a container (`nn.ModuleList`, `nn.ModuleDict`, `nn.Sequential`)
of modules of one class are the blocks. Failing that, the top-level children that hold
the bulk of the parameters are. Users may name the block classes themselves
(`--blocks Block,Other`).
"""

from __future__ import annotations

from torch import nn

from dtrain.errors import ConfigError


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _total(modules: list[nn.Module]) -> int:
    return sum(_num_params(m) for m in modules)


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
"""Modules that hold others: blocks are found inside them, never taken as a block (FSDP2
cannot shard a container without a forward of its own, ``nn.ModuleDict``)."""


def _repeated(container: nn.Module) -> list[nn.Module]:
    """The children of `container` if they are all of one class (the repeated blocks of a
    transformer, under any key: ``layers.0`` or ``layers["0"]``), else nothing."""
    children = list(container.children())
    if not children or len({type(child) for child in children}) > 1:
        return []
    return children


def _repeated_kinds(model: nn.Module) -> dict[type, list[nn.Module]]:
    """Each class that some container of `model` holds as its only kind of child, with
    every such child (in module order, one outermost: a block holding another of its class
    stands for both)."""
    kinds: dict[type, list[nn.Module]] = {}
    inside: set[int] = set()
    for module in model.modules():
        if not isinstance(module, CONTAINERS):
            continue
        for child in _repeated(module):
            if id(child) not in inside:
                kinds.setdefault(type(child), []).append(child)
                inside.update(id(m) for m in child.modules())
    return kinds


def _without_containers(modules: list[nn.Module]) -> list[nn.Module]:
    """`modules` with every container replaced by its children, recursively."""
    out: list[nn.Module] = []
    for module in modules:
        if isinstance(module, CONTAINERS):
            out.extend(_without_containers([c for c in module.children() if _num_params(c)]))
        else:
            out.append(module)
    return out


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The blocks of `model`, in forward order (best effort: module registration order).

    The repeated blocks are the modules of one class that containers (``ModuleList``,
    ``ModuleDict`` or ``Sequential``, however deep) hold as their only kind of child, two
    or more in all: of such classes, the one whose modules hold the most parameters, every
    module of it that no other holds (a ResNet's blocks span its four stages). Failing
    that (a model of one block), the top-level children holding the bulk of the
    parameters, a container among them stood for by its children (its one block)."""
    if class_names:
        blocks = [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
        if not blocks:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"No submodule of class {', '.join(class_names)} in the model; its classes "
                f"are: {', '.join(found)}. Pass the class names of its repeated blocks."
            )
        return blocks
    # The class whose repeated modules hold the most; the first one found on a tie, so
    # that every rank picks the same.
    repeated = [kind for kind in _repeated_kinds(model).values() if len(kind) > 1]
    best = max(repeated, key=_total, default=[])
    if _total(best):
        return best
    total = _num_params(model)
    children = [c for c in model.children() if _num_params(c) > 0]
    bulk = [c for c in children if _num_params(c) * 2 * max(len(children), 1) >= total]
    return _without_containers(bulk)


def self_contained(unit: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The `blocks` of `unit` none of whose parameters is also held outside the block
    (``head.weight = embedding.weight`` ties a head to an embedding): FSDP2 and compiled
    blocks need each parameter to belong to one of them."""
    holders: dict[int, set[str]] = {}
    for name, param in unit.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), set()).add(name)
    prefix = {id(m): name for name, m in unit.named_modules(remove_duplicate=False)}
    kept = []
    for block in blocks:
        start = prefix[id(block)] + "."
        if all(
            all(n.startswith(start) for n in holders[id(p)])
            for _, p in block.named_parameters(remove_duplicate=False)
        ):
            kept.append(block)
    return kept
