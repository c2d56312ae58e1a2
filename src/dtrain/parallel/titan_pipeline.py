"""torchtitan's decoders as a chain of pipeline layers, read from the layout its forward
promises.

torchtitan's `Decoder` (Llama3 and the models built on it) keeps its token embeddings,
its blocks in an ``nn.ModuleDict`` named ``layers``, its final norm and its head as
children, and its forward is their composition, each block called as
``block(h, attention_masks, positions)``; called on the tokens alone, both are None.
torchtitan's own pipeline relies on that forward (a stage is the model with the other
children removed). The chain here is the same composition, each block given the Nones
the forward gives it, under the children's names (``layers.3``). A subclass with a
forward of its own may compose otherwise and is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain.errors import ConfigError


def _decoder_class(model: nn.Module) -> type | None:
    """torchtitan's `Decoder` among the classes of `model`, if it is one (found by name:
    dtrain does not import torchtitan)."""
    for cls in type(model).__mro__:
        if cls.__name__ == "Decoder" and cls.__module__.startswith("torchtitan."):
            return cls
    return None


def is_titan_decoder(model: nn.Module) -> bool:
    """True if `model` is one of torchtitan's decoders."""
    return _decoder_class(model) is not None


class _Block(nn.Module):
    """A block called as the decoder's forward calls it on tokens alone: no attention
    masks, no positions (its attention then runs causal over positions 0..T-1)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h, None, None)


def titan_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The chain of (name, layer) whose composition is the forward of torchtitan decoder
    `model` on tokens: embeddings, blocks, norm, head, each where the model has it."""
    decoder = _decoder_class(model)
    owner = next(c for c in type(model).__mro__ if "forward" in vars(c))
    if owner is not decoder:
        raise ConfigError(
            f"{type(model).__name__} is a torchtitan decoder whose forward "
            f"({owner.__name__}.forward) is its own, so dtrain cannot tell its chain of "
            "layers; add a pipeline_layers() method to it (docs/strategies.md)."
        )
    children = dict(model.named_children())
    layers: nn.ModuleDict = children["layers"]  # type: ignore[assignment]
    blocks = [(f"layers.{k}", _Block(block)) for k, block in layers.items()]
    # The forward passes over a child set to None, and ends at the norm when torchtitan's
    # trainer computes the head inside its loss.
    head = [] if getattr(model, "_skip_lm_head", False) else ["lm_head"]
    ends = [(n, children.get(n)) for n in ["tok_embeddings", "norm", *head]]
    chain = [ends[0], *blocks, *ends[1:]]
    return [(name, layer) for name, layer in chain if layer is not None]
