"""Models we did not write, tiny and with random weights (nothing downloaded), trained for a
few steps under any strategy with only the dtrain lines added, so that tests can compare
the result with `single`.

Hugging Face: Llama (grouped-query attention), Qwen2 (its output layer tied to the
embedding) and GPT-NeoX causal language models, trained on dict batches ``{"input_ids",
"labels"}`` with the loss the model computes itself; and, from tests/hf_training.py, the
BERT classifier and GPT-2. torchtitan: its Llama3, built from a config in code as its own
trainer builds it, trained on ``(inputs, targets)`` batches with cross-entropy over the
logits. No plan is written for any Hugging Face model: tensor and pipeline parallelism
must find what they need in the model (its config's ``base_model_tp_plan``, its blocks).
torchvision: a ResNet-18 laid out as its own (tests/resnet18.py, since PyPI's torchvision
does not import beside the CPU torch), on small random images with cross-entropy.
"""

from __future__ import annotations

import contextlib
import gc
import os
from functools import cache, partial
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812 - torch's usual alias
from hf_training import BERT_TP_PLAN, Tokens, prompt_masked  # noqa: E402
from hf_training import build as build_hf_classic  # noqa: E402
from resnet18 import resnet18  # noqa: E402
from titan_like import TitanLike  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from training import finish  # noqa: E402
from transformers import (  # noqa: E402
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import dtrain  # noqa: E402
from dtrain.errors import ConfigError, SetupError  # noqa: E402

VOCAB, LENGTH, SAMPLES, GLOBAL_BATCH = 64, 8, 64, 8
HF_LM_KINDS = ("llama", "qwen2", "neox")
"""The Hugging Face causal language models of the matrix."""
CLASSIC_KINDS = ("bert", "gpt2")
"""tests/hf_training.py's BERT classifier and GPT-2 (trained on its own token set)."""
TITAN = "titan"
"""torchtitan's Llama3."""
TITAN_LIKE = "titan_like"
"""tests/titan_like.py: torchtitan's habits in a model of our own (runs where torchtitan is
not installed): blocks in a ``ModuleDict`` named ``layers`` called with the rotary table,
a complex64 table rebound by ``init_weights``, which the trainer calls after the build."""
RESNET = "resnet18"
"""A ResNet-18 after torchvision's layout (BatchNorm in every block)."""
ATTENTION = "sdpa"
"""Hugging Face's attention: torch's scaled_dot_product_attention, as models load by
default."""


class CausalTokens(Dataset):
    """Random token sequences: ``{"input_ids", "labels"}`` dicts (a Hugging Face model
    shifts the labels itself; a prompt is left out of the loss: `prompt_masked`), or with
    `pairs` ``(inputs, targets)`` shifted by one."""

    def __init__(self, pairs: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=generator)
        self.pairs = pairs

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Any:
        if self.pairs:
            return self.ids[i, :-1], self.ids[i, 1:]
        return {"input_ids": self.ids[i, :-1], "labels": prompt_masked(self.ids[i, :-1], i)}


class Images(Dataset):
    """Random 3x16x16 images with one of 10 classes: ``(image, label)`` pairs."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(SAMPLES, 3, 16, 16, generator=generator)
        self.labels = torch.randint(0, 10, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (N, T, vocab) logits against (N, T) next tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hf_lm(kind: str) -> nn.Module:
    """A tiny Hugging Face causal LM: 2 layers of width 32, 4 heads (2 key/value heads for
    Llama and Qwen2), no dropout."""
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": LENGTH,
        "use_cache": False,
        "attn_implementation": ATTENTION,
    }
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **shape))
    if kind == "qwen2":
        config = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **shape)
        return Qwen2ForCausalLM(config)
    config = GPTNeoXConfig(attention_dropout=0.0, hidden_dropout=0.0, **shape)
    return GPTNeoXForCausalLM(config)


@cache
def titan_missing() -> str | None:
    """Why torchtitan's Llama3 cannot be built here (not importable), or None (asked once:
    importing it takes seconds)."""
    try:
        import torchtitan.models.llama3  # noqa: F401 - only whether it imports
    except ImportError as e:
        return f"torchtitan is not importable here: {e}"
    return None


def titan_llama3() -> nn.Module:
    """torchtitan's Llama3 at width 32 (4 heads, 2 key/value heads, fused q/k/v as its
    shipped flavours have it), 2 layers, torch's SDPA inside the attention. Built, not
    initialised: call its ``init_states()`` (or let `engine.setup` initialise a model built
    inside `engine.init_empty`)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    dim, heads = 32, 4
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}

    def block() -> Llama3TransformerBlock.Config:
        # get_attention_config refuses "sdpa" (it wants document masks); the model takes
        # torch's SDPA when given its config directly, causal over the whole sequence.
        attention = make_gqa_config(
            dim=dim,
            n_heads=heads,
            n_kv_heads=2,
            wqkv_param_init=linear,
            wo_param_init=linear,
            inner_attention=ScaledDotProductAttention.Config(),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=LENGTH, theta=10000.0),
            fuse_qkv=True,
        )
        return Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            attention=attention,
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=64, w1_param_init=linear, w2w3_param_init=linear
            ),
        )

    embedding_init = {"weight": partial(nn.init.normal_, std=1.0)}
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=embedding_init
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=linear),
        layers=[block() for _ in range(2)],
    )
    return config.build()


def titan_tensor_plan(degree: int) -> dict[str, str]:
    """The Megatron split of torchtitan's Llama3 blocks: q/k/v and the feed-forward's
    gate and up projections by columns (whole heads per rank), the attention's output and
    the feed-forward's down projection by rows."""
    return {
        "layers.*.attention.qkv_linear.wqkv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
    }


def build(kind: str, empty: bool) -> nn.Module:
    """The model `kind`, initialised unless it was built `empty` (inside
    `engine.init_empty`, where setup initialises it)."""
    if kind in CLASSIC_KINDS:
        return build_hf_classic(kind)
    if kind == RESNET:
        return resnet18(num_classes=10, width=8)
    if kind == TITAN_LIKE:
        model = TitanLike()
        if not empty:
            model.init_weights()
        return model
    if kind == TITAN:
        model = titan_llama3()
        if not empty:
            model.init_states()
        return model
    return hf_lm(kind)


def dataset(kind: str) -> Dataset:
    """The token set `kind` trains on."""
    if kind in CLASSIC_KINDS:
        return Tokens(kind)
    if kind == RESNET:
        return Images()
    return CausalTokens(pairs=kind in (TITAN, TITAN_LIKE))


def train_model(
    kind: str, steps: int = 4, close: bool = True, init_empty: bool = False, **options: Any
) -> dict[str, torch.Tensor] | str | None:
    """Train `kind` for `steps` AdamW steps on global batches of `GLOBAL_BATCH` under
    `options` (of dtrain.init); the parameters and buffers on the main rank (canonical
    names), None elsewhere, or ``"refused: <message>"`` when dtrain refused the run by
    name. With `init_empty` the model is built inside `engine.init_empty()`.
    `close=False` keeps the process group for another run."""
    try:
        engine = dtrain.init(seed=0, **options)
    except ConfigError as e:
        return f"refused: {e}"
    try:
        _fit(engine, kind, steps, init_empty)
    except (ConfigError, SetupError) as e:
        # Refused alike on every rank: end the run and let the next one of the job start.
        # (Anything else fails the job, every rank's traceback shown by run_ranks.)
        gc.collect()
        engine.close() if close else engine.strategy.close()
        return f"refused: {e}"
    return finish(engine, close)


def _fit(engine: dtrain.Engine, kind: str, steps: int, init_empty: bool) -> None:
    """Build, set up and train `kind` (the model dies with this frame, before teardown)."""
    with engine.init_empty() if init_empty else contextlib.nullcontext():
        model = build(kind, empty=init_empty)
    if engine.strategy.name in ("tensor", "hybrid"):
        # Neither model carries a plan dtrain can read (BERT's config has none, torchtitan
        # keeps its plans in its trainer): the user gives one, as docs/strategies.md says.
        if kind == "bert":
            model.tensor_parallel_plan = lambda degree: BERT_TP_PLAN  # type: ignore[method-assign]
        elif kind == TITAN:
            model.tensor_parallel_plan = titan_tensor_plan  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(dataset(kind), global_batch_size=GLOBAL_BATCH)
    # None: a Hugging Face model's own loss.
    loss_fn = {TITAN: next_token_loss, TITAN_LIKE: next_token_loss, RESNET: F.cross_entropy}.get(
        kind
    )
    for batch in engine.progress(loader):
        engine.train_step(batch, loss_fn)
        if engine.step == steps:
            break


def train_model_variants(variants: list[dict[str, Any]]) -> list[Any]:
    """`train_model` for each of `variants` one after the other in this process group (the
    last closes it)."""
    last = len(variants) - 1
    return [train_model(close=i == last, **variant) for i, variant in enumerate(variants)]
