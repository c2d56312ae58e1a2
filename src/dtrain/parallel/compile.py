"""`torch.compile` applied after parallelising, block by block.

PyTorch's documentation has users write ``model = torch.compile(model)`` before training.
Given such a model, a strategy would shard, split or rename a wrapper (`OptimizedModule`,
whose parameter names gain ``_orig_mod.``) instead of the model, and the compiled graph
would hold parameters that sharding then replaces. So `engine.setup` takes the module out
of its wrapper (`unwrap_compiled`), the strategy parallelises it, and `compile_blocks`
compiles each repeated block in place, after tensor parallelism and before data
parallelism wraps it (torchtitan's order): names stay canonical, and each block's graph
is traced once and reused by blocks of the same class.
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain.errors import ConfigError


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module inside a ``torch.compile`` wrapper, True), or (`model`, False)."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, True
    return model, False


def compile_blocks(model: nn.Module, blocks: list[nn.Module], backend: str = "inductor") -> None:
    """Compile each of `blocks` in place (`nn.Module.compile`) with `backend`, or the whole
    `model` when it has no blocks; parameter names and objects are unchanged."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"--compile-backend {backend!r} is not a torch.compile backend; use one of "
            f"{', '.join(sorted(known))} (inductor is torch's default)."
        )
    for block in blocks or [model]:
        block.compile(backend=backend)
