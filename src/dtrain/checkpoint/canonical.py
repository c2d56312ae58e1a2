"""Canonical parameter names: those of the user's unwrapped model.

Wrappers add prefixes to state_dict keys: ``module.`` (DataParallel, DDP, our towers),
``_orig_mod.`` (torch.compile), ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.``
(FSDP1 and activation checkpointing). A checkpoint stores names without any of them.
"""

from __future__ import annotations

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


_INNER_WRAPPERS = {p.rstrip(".") for p in WRAPPER_PREFIXES if p != "module."}


def canonical_name(name: str) -> str:
    """`name` without wrapper prefixes.

    ``module.`` is removed only at the front (repeatedly), since a user's model may well
    have a submodule called ``module``; the other wrapper names are removed anywhere.
    """
    while name.startswith("module."):
        name = name[len("module.") :]
    return ".".join(p for p in name.split(".") if p not in _INNER_WRAPPERS)


def canonical_state_dict(state: dict[str, object]) -> dict[str, object]:
    """`state` with every key made canonical; an error if two keys collide."""
    out: dict[str, object] = {}
    for key, value in state.items():
        name = canonical_name(key)
        if name in out:
            raise ValueError(f"State dict keys collide after removing wrapper prefixes: {name}.")
        out[name] = value
    return out
