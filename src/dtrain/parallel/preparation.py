"""What every layout does to the user's model around placing it, written once.

A strategy takes the model out of a ``torch.compile`` wrapper (`unwrap`), places or splits
it as its layout needs, then checkpoints the activations of its blocks and compiles them
in place (`finish`, torchtitan's order: after tensor parallelism, before data-parallel
wrappers). A layout that must refuse before anything leaves the process (the parameter
server tells its servers at setup) runs the two halves of `finish` apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dtrain.config import Config
from dtrain.parallel.activation_checkpointing import apply_activation_checkpointing
from dtrain.parallel.blocks import find_blocks, self_contained
from dtrain.parallel.compile import compile_blocks, unwrap_compiled


@dataclass(frozen=True)
class Preparation:
    """How the blocks of one model are prepared (from --activation-checkpointing, --blocks,
    --compile and --compile-backend, and whether the model came in compiled)."""

    activation_checkpointing: str
    blocks: list[str] | None
    compile: bool
    """True with --compile, or when the user passed a compiled model: its blocks are
    compiled in place once placed."""
    backend: str

    def checkpoint(self, model: nn.Module) -> None:
        """Recompute `model`'s blocks in backward, as --activation-checkpointing says."""
        apply_activation_checkpointing(model, self.activation_checkpointing, self.blocks)

    def compile_blocks(self, model: nn.Module, blocks: list[nn.Module] | None = None) -> None:
        """Compile `blocks` (default: `model`'s own, found as `dtrain.parallel.blocks`
        finds them) in place, when the model is to be compiled."""
        if not self.compile:
            return
        if blocks is None:
            blocks = self_contained(model, find_blocks(model, self.blocks))
        compile_blocks(model, blocks, self.backend)

    def finish(self, model: nn.Module) -> None:
        """Checkpoint, then compile, `model`'s blocks: the end of a layout that places the
        whole model (single, towers' replicas)."""
        self.checkpoint(model)
        self.compile_blocks(model)


def unwrap(model: nn.Module, config: Config) -> tuple[nn.Module, Preparation]:
    """(`model` out of its ``torch.compile`` wrapper if it has one, how to prepare it)."""
    inner, compiled = unwrap_compiled(model)
    preparation = Preparation(
        config.activation_checkpointing,
        config.blocks,
        config.compile or compiled,
        config.compile_backend,
    )
    return inner, preparation
