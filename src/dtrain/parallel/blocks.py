"""Which submodules are a model's repeated blocks (the units to shard, prefetch or split).

Transformer layers held in an `nn.ModuleList` (or `nn.Sequential`) of modules of one class
are the blocks. Failing that, the top-level children that hold the bulk of the parameters
are. Users may name the block classes themselves (`--blocks Block,Other`).
"""

from __future__ import annotations

from torch import nn

from dtrain.errors import ConfigError


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The blocks of `model`, in forward order (best effort: module registration order)."""
    if class_names:
        blocks = [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
        if not blocks:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"No submodule of class {', '.join(class_names)} in the model; its classes "
                f"are: {', '.join(found)}. Pass the class names of its repeated blocks."
            )
        return blocks
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            kinds = {type(child) for child in module}
            holds = sum(_num_params(child) for child in module)
            if len(kinds) == 1 and holds > sum(_num_params(b) for b in best):
                best = list(module)
    if best:
        return best
    total = _num_params(model)
    children = [c for c in model.children() if _num_params(c) > 0]
    return [c for c in children if _num_params(c) * 2 * max(len(children), 1) >= total]


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
