"""A Hugging Face causal LM as a chain of pipeline layers, read from its own pp plan.

Hugging Face configs name the modules a pipeline cuts (``base_model_pp_plan``: for Llama
``embed_tokens``, ``layers``, ``norm``) and the model class its head (``_pp_plan``:
``lm_head``). The decoder layers need more than the hidden states the plan passes
between stages: the rotary position embeddings, which the base model computes once from
its rotary module (``rotary_emb``), and the causal mask. Each decoder layer's wrapper
here computes both again from the hidden states it is given, as the base model's forward
does, so only the hidden states travel between stages; the rotary module, whose tables
are buffers, is held by every stage that runs a decoder layer.

The chain's names are the modules' paths in the model (``model.layers.3``), so stages,
split points and checkpoints keep the model's names. A dict batch feeds it: its
``input_ids`` go to the first stage, its ``attention_mask`` (padding) to every stage,
and its ``labels`` to the last, which computes the model's own loss
(``model.loss_function``, with Hugging Face's shift of the labels) on the logits.

Only the model types whose base forward is known to be this chain are read
(`VERIFIED`); another is refused by name rather than split into a chain that might
compute something else (a model that scales its embeddings in its forward, or masks
some layers with a sliding window its config does not name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.step.batches import DictFeed, label_counter

VERIFIED = ("llama", "qwen2", "gpt_neox")
"""Model types whose base forward is the plan's modules in order, each decoder layer given
rotary position embeddings and a causal (or, per ``config.layer_types``, sliding-window)
mask. Add one only with a test that the chain's loss equals the model's forward loss
(tests/test_pipeline_models.py)."""


def has_pp_plan(model: nn.Module) -> bool:
    """True if `model` is a Hugging Face model whose config carries a pipeline plan."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "base_model_pp_plan", None))


class _Step(nn.Module):
    """A module of the plan that maps one tensor to one (embeddings, dropout, final norm,
    head); a padding mask every stage is given is not its concern."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.module(x)


class _DecoderLayer(nn.Module):
    """A decoder layer given what the base model's forward gives it: positions 0..T-1,
    their rotary embeddings, and the mask the model builds for this layer's kind."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any, mask: Any) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.mask = mask

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N, T, hidden) -> (N, T, hidden); `attention_mask` (N, T) marks padding."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = self.mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=positions,
        )
        return self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
            use_cache=False,
        )


def _check_verified(model: nn.Module) -> None:
    kind, config = type(model).__name__, model.config  # type: ignore[union-attr]
    model_type = getattr(config, "model_type", "")
    if model_type not in VERIFIED or not kind.endswith("ForCausalLM"):
        raise ConfigError(
            f"{kind} (model_type {model_type!r}) has a pipeline plan in its config, but "
            f"dtrain splits by that plan only the causal LMs of {', '.join(VERIFIED)}, whose "
            "forward it is known to reproduce. Add a pipeline_layers() method to the model "
            "(docs/strategies.md), or use a strategy that does not split it (ddp, zero3)."
        )


def _mask_functions(config: Any, count: int) -> list[Any]:
    """The mask function of each of `count` decoder layers, by its kind in the config."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    kinds = {
        "full_attention": create_causal_mask,
        "sliding_attention": create_sliding_window_causal_mask,
    }
    types = getattr(config, "layer_types", None) or ["full_attention"] * count
    unknown = sorted({t for t in types if t not in kinds})
    if unknown or len(types) != count:
        raise ConfigError(
            f"The decoder layers of this model are of kinds {', '.join(unknown) or '?'} "
            f"({len(types)} kinds for {count} layers), which a pipeline stage cannot mask as "
            "the model does; add a pipeline_layers() method to the model."
        )
    return [kinds[t] for t in types]


def hf_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The chain of (path in `model`, layer) whose composition is the causal LM's forward
    up to its logits: the base model's plan, then the head from the class's plan."""
    _check_verified(model)
    config = model.config  # type: ignore[union-attr]
    prefix = model.base_model_prefix  # type: ignore[union-attr]
    base = model.get_submodule(prefix)
    head_plan = dict(getattr(type(model), "_pp_plan", None) or {})
    chain: list[tuple[str, nn.Module]] = []
    for name in config.base_model_pp_plan:
        module = base.get_submodule(name)
        if not isinstance(module, nn.ModuleList):
            chain.append((f"{prefix}.{name}", _Step(module)))
            continue
        if len(module) != config.num_hidden_layers:
            raise ConfigError(
                f"{type(model).__name__}.{prefix}.{name} holds {len(module)} layers for "
                f"num_hidden_layers={config.num_hidden_layers}; a pipeline runs every layer "
                "it holds, so build the model with as many layers as its config names."
            )
        masks = _mask_functions(config, len(module))
        rotary = base.get_submodule("rotary_emb")
        chain += [
            (f"{prefix}.{name}.{i}", _DecoderLayer(layer, rotary, config, masks[i]))
            for i, layer in enumerate(module)
        ]
    chain += [(name, _Step(model.get_submodule(name))) for name in head_plan]
    return chain


def hf_feed(model: nn.Module) -> DictFeed:
    """How a dict batch drives the chain of `model` (`hf_layers`) and where its loss is
    computed: the model's own loss function on the last stage's logits."""
    config = model.config  # type: ignore[union-attr]
    first_inputs = next(iter(config.base_model_pp_plan.values()))[0]

    def own_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(  # type: ignore[operator]
            logits=logits, labels=labels, vocab_size=config.vocab_size
        )

    return DictFeed(
        inputs=first_inputs[0],
        targets="labels",
        extras=("attention_mask",),
        loss=own_loss,
        count=counter.count_labels if (counter := label_counter(model)) else None,
        model=type(model).__name__,
    )
