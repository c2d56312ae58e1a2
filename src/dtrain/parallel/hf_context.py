"""A Hugging Face model's attention under context parallelism.

transformers builds an attention mask from the positions it is given: the head-and-tail
positions of a context-parallel cut look like packed sequences to it, so it would build a
mask for the rank's slice alone. For the length of a step its attention is switched to
transformers' own sdpa function under a name of dtrain's, for which transformers builds no
mask: the attention is then ``F.scaled_dot_product_attention(..., is_causal=True)``, which
the cut attends over the whole sequence (`dtrain.parallel.context_parallel`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from dtrain.errors import ConfigError

UNMASKED = "dtrain_context_parallel_sdpa"
"""The attention implementation's name while a step runs: transformers' sdpa function."""


def attention_switch(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What switches `model`'s attention for a step: transformers' sdpa without a mask for
    a Hugging Face model (refused by name unless it attends with sdpa), nothing for any
    other model."""
    if "transformers" not in sys.modules:  # a Hugging Face model was never built here
        return contextlib.nullcontext
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(model, PreTrainedModel):
        return contextlib.nullcontext
    config = model.config
    if config._attn_implementation != "sdpa":
        raise ConfigError(
            f"--cp attends over the whole sequence through torch's scaled_dot_product_"
            f"attention, but {type(model).__name__} attends with "
            f"'{config._attn_implementation}'; build it with attn_implementation='sdpa', or "
            "drop --cp."
        )
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or []
    if (window is not None and getattr(config, "use_sliding_window", True)) or any(
        "sliding" in str(kind) for kind in kinds
    ):
        raise ConfigError(
            f"{type(model).__name__} attends within a sliding window of {window} tokens, "
            "which --cp's causal attention over the whole sequence cannot honour; drop "
            "--cp, or set the config's sliding_window to None if your sequences are no "
            "longer than the window."
        )
    AttentionInterface.register(UNMASKED, sdpa_attention_forward)

    @contextlib.contextmanager
    def switched() -> Iterator[None]:
        config._attn_implementation = UNMASKED
        try:
            yield
        finally:
            config._attn_implementation = "sdpa"

    return switched
