"""The tensor-parallel plan a Hugging Face model declares, as paths in the whole model.

transformers' configs carry ``base_model_tp_plan``, keyed by paths inside the base model
(``layers.*.self_attn.q_proj``, under ``model.`` in a LlamaForCausalLM), and a task
model's class the plan of its head (``_tp_plan = {"lm_head": "colwise_gather_output"}``).
A model without a ``tensor_parallel_plan`` method of its own trains under these (read by
duck typing: dtrain does not import transformers). Their style names are Hugging Face's
(`dtrain.parallel.tensor_plan.STYLES` maps them); ``packed_colwise`` there means two
parts, [gate; up].

The attention of these models reshapes by head size (``view(..., -1, head_dim)``), so a
column split of q, k and v runs on a rank's whole heads unchanged: the degree must divide
the attention heads and the key/value heads.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

from torch import nn

from dtrain.errors import ConfigError

HEAD_COUNTS = {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads"}
"""Config fields counting the heads a column split of the attention divides."""


def declared_plan(model: nn.Module, degree: int) -> dict[str, str] | None:
    """{module path in `model`: style name} from `model`'s Hugging Face config and class, or
    None when it declares none; refuses a `degree` that does not divide its heads."""
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        return None
    _check_heads(type(model).__name__, config, degree)
    base = getattr(model, "base_model", model)
    prefix = next((f"{path}." for path, m in model.named_modules() if m is base and path), "")
    plan = {prefix + path: style for path, style in base_plan.items()}
    plan |= getattr(type(model), "_tp_plan", None) or {}
    plan = {path: "packed_colwise:2" if s == "packed_colwise" else s for path, s in plan.items()}
    return _with_tied_embedding(model, plan)


def _check_heads(cls: str, config: Any, degree: int) -> None:
    for field, what in HEAD_COUNTS.items():
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % degree:
            fits = [d for d in range(2, min(heads, 8) + 1) if heads % d == 0]
            such = f" (such as {' or '.join(map(str, fits[:3]))})" if fits else ""
            raise ConfigError(
                f"--tp {degree} does not divide the {heads} {what} of {cls} (config.{field}); "
                "the tensor-parallel plan of its Hugging Face config gives each rank whole "
                f"attention heads. Pick a --tp that divides {heads}{such}."
            )


def _with_tied_embedding(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan`, with the input embedding split over the vocabulary when the plan splits an
    output head tied to it (tie_word_embeddings), as transformers does: the one weight then
    has one layout (the head's colwise split is over the vocabulary too)."""
    inputs = getattr(model, "get_input_embeddings", None)
    outputs = getattr(model, "get_output_embeddings", None)
    if not callable(inputs) or not callable(outputs):
        return plan
    embed, head = inputs(), outputs()
    if not isinstance(embed, nn.Embedding) or getattr(head, "weight", None) is not embed.weight:
        return plan
    path = {id(m): p for p, m in model.named_modules()}

    def named(module: nn.Module) -> bool:
        return any(fnmatch(path[id(module)], p) for p in plan)

    if named(head) and not named(embed):
        return {path[id(embed)]: "embedding_rowwise", **plan}
    return plan
