"""What a build inside ``engine.init_empty`` may not do, since setup could not replay it
bit for bit (`dtrain.parallel.materialize`): each refused by name, saying what to do."""

from __future__ import annotations

from torch import nn

from dtrain.errors import SetupError
from dtrain.parallel.build_record import BuildRecord, InitCall, Layout, layout

OUTSIDE = "or build the model outside engine.init_empty"
"""The way out every refusal offers."""


def _named(model: nn.Module, module: nn.Module | None) -> str:
    """`module` as a message names it: its path in `model` and class."""
    if module is None:
        return "code outside any module's constructor"
    path = next((p for p, m in model.named_modules() if m is module), None)
    where = "" if path is None else f"module '{path or 'model'}' "
    return f"the constructor of {where}({type(module).__name__})"


def refuse_unreplayable(model: nn.Module, record: BuildRecord) -> None:
    """Refuse a build whose record cannot be replayed exactly (see the module's docstring)."""
    if record.unreplayable:
        first = record.unreplayable[0]
        more = len(record.unreplayable) - 1
        raise SetupError(
            f"While the model was built inside engine.init_empty, {_named(model, first.owner)} "
            f"initialised a tensor in a way setup cannot replay ({first.what}"
            f"{f', and {more} more' if more else ''}); do it in a reset_parameters() or "
            f"init_weights() method, with whole tensors and torch.nn.init, {OUTSIDE}."
        )
    if record.reseeded:
        first = record.reseeded[0]
        raise SetupError(
            f"While the model was built inside engine.init_empty, {_named(model, first.owner)} "
            f"set the random state ({first.what}) after the build's initialisation had begun, "
            "which setup cannot replay from one starting state; seed once before building the "
            f"model, {OUTSIDE}."
        )
    if record.drew_on_cpu:
        raise SetupError(
            "Random numbers were drawn on the CPU while the model was built inside "
            "engine.init_empty, once its initialisation had begun (a tensor made with "
            "device='cpu', or a seed set there), which a build on the meta device cannot "
            "replay; seed before building and make the model's tensors on the default "
            f"device, {OUTSIDE}."
        )
    for step in record.steps:
        if isinstance(step, InitCall):
            _refuse_changed_since(model, step)
    for path, module in model.named_modules():
        has_init = callable(getattr(module, "init_weights", None))
        if path and has_init and module not in record.init_weights_ran:
            raise SetupError(
                f"Module '{path}' ({type(module).__name__}) defines init_weights(), but the "
                "model's build inside engine.init_empty never called it, so setup cannot tell "
                "when a whole build would; call it from its constructor or from the model's "
                f"init_weights(), {OUTSIDE}."
            )


def _change(before: Layout, now: Layout) -> str | None:
    """What changed in a module tree from `before` to `now` (None: nothing), in words."""
    if before == now:
        return None
    was = {path: (module, names) for path, module, names in before}
    changes = []
    for path, module, names in now:
        old = was.pop(path, None)
        if old is None:
            changes.append(f"{path} added")
        elif old[0] != module:
            changes.append(f"{path} replaced")
        elif old[1] != names:
            changes.append(f"the tensors of {path or 'the module itself'} changed")
    changes += [f"{path} removed" for path in was]
    return ", ".join(changes) or "its modules reordered"


def _refuse_changed_since(model: nn.Module, call: InitCall) -> None:
    """Refuse a model whose module tree under `call` changed after the call ran in the build:
    setup replays the call on the tree as it is now, which a whole build never ran it on."""
    change = _change(call.tree, layout(call.module))
    if change is None:
        return
    path = next((p for p, m in model.named_modules() if m is call.module), None)
    where = "A module no longer in the model" if path is None else f"Module '{path or 'model'}'"
    raise SetupError(
        f"{where} ({type(call.module).__name__}) was changed after its {call.method}() ran "
        f"inside engine.init_empty ({change}), so setup cannot replay that call as the build "
        "ran it; make the change in its constructor before it calls "
        f"{call.method}(), {OUTSIDE}."
    )
