"""Activation checkpointing (``--activation-checkpointing none|full|selective``).

A checkpointed block keeps only its inputs from forward and runs its forward again in
backward to get the activations its gradient needs: activation memory traded for about
one more forward of compute. `full` checkpoints every repeated block (the blocks
`dtrain.parallel.blocks.find_blocks` finds, the units FSDP shards); `selective` every
other one, the second, fourth, ... (torchtitan's layer-level selective checkpointing with
frequency 2), for about half the saving at half the extra compute.

Each block runs under `torch.utils.checkpoint.checkpoint` with ``use_reentrant=False``,
what torch's ``checkpoint_wrapper`` runs it under, with the RNG state preserved (dropout
draws the same mask in the recomputation). Rather than replacing the block by a
``CheckpointWrapper``, whose parameter names gain ``_checkpoint_wrapped_module.``, the
block's ``forward`` is set on the block itself: names, state_dict keys, checkpoints and
optimizer state stay canonical, and a checkpoint loads whether or not either run
checkpointed. The forward is a method bound to the block, so a copy of the model
(``copy.deepcopy``, towers' replicas) recomputes its own block. Strategies apply this after
tensor parallelism and before compiling and the data-parallel wrappers (torchtitan's
order), so a compiled block traces the checkpoint with it.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from dtrain.errors import ConfigError
from dtrain.parallel.blocks import find_blocks


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's own forward, its activations recomputed in backward."""
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    """True if `block`'s forward runs under activation checkpointing."""
    return getattr(block.forward, "__func__", None) is _checkpointed_forward


def checkpointed_blocks(
    model: nn.Module, mode: str, class_names: list[str] | None = None
) -> list[nn.Module]:
    """The blocks of `model` that `mode` checkpoints (`class_names` being ``--blocks``);
    a ConfigError naming the fix where checkpointing them cannot work."""
    if mode == "none":
        return []
    blocks = find_blocks(model, class_names)
    if not blocks:
        raise ConfigError(
            f"--activation-checkpointing {mode} recomputes the model's repeated blocks, but "
            f"none was found in {type(model).__name__}; name the classes of its blocks with "
            "--blocks (dtrain.init(blocks=[...])), or drop --activation-checkpointing."
        )
    chosen = blocks if mode == "full" else blocks[1::2]
    if not chosen:
        raise ConfigError(
            f"--activation-checkpointing selective checkpoints every other block (the second, "
            f"fourth, ...), but {type(model).__name__} has one block; use full, or name finer "
            "blocks with --blocks."
        )
    names = {id(m): n for n, m in model.named_modules()}
    for block in chosen:
        _check_recomputable(names[id(block)], block)
    return chosen


def _check_recomputable(name: str, block: nn.Module) -> None:
    """Refuse block `name` where recomputing it would not be the same forward: a BatchNorm
    would update its running statistics twice per step (a synchronised one would also
    all-reduce again), leaving the model other than one trained without checkpointing; a
    forward already set on the instance would be bypassed."""
    norms = [
        f"{name}.{n}".rstrip(".") for n, m in block.named_modules() if isinstance(m, _BatchNorm)
    ]
    if norms:
        raise ConfigError(
            f"--activation-checkpointing would run the forward of block {name} twice per "
            f"step, updating the running statistics of its BatchNorm layer(s) "
            f"{', '.join(norms[:3])} twice; name blocks without BatchNorm with --blocks, "
            "or drop --activation-checkpointing."
        )
    if "forward" in vars(block) and not is_checkpointed(block):
        raise ConfigError(
            f"Block {name} has a forward set on the instance (a hook library's wrapper), "
            "which activation checkpointing would bypass; remove it before engine.setup, or "
            "drop --activation-checkpointing."
        )


def apply_activation_checkpointing(
    model: nn.Module, mode: str, class_names: list[str] | None = None
) -> None:
    """Checkpoint the blocks of `model` that `mode` (none, full or selective) names, in
    place; parameter names and objects are unchanged, and a block already checkpointed
    (the same model set up again) is left as it is."""
    for block in checkpointed_blocks(model, mode, class_names):
        if not is_checkpointed(block):
            block.forward = types.MethodType(_checkpointed_forward, block)
