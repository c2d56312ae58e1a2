"""Tensor-parallel plans beyond colwise and rowwise: a fused [q; k; v] layer split part by
part (packed_colwise), and Hugging Face models trained under the plan their config
declares (no plan written), each equal to one process after a few AdamW steps: a tiny
Llama, a Qwen2 whose head is tied to its embedding, a GPT-NeoX (one fused, per-head
interleaved query_key_value layer) and a nanoGPT-like model with one fused c_attn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from distributed import run_ranks  # noqa: E402
from hf_training import LENGTH, VOCAB, Tokens  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from training import finish  # noqa: E402
from transformers import (  # noqa: E402
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import dtrain  # noqa: E402
from dtrain.errors import ConfigError  # noqa: E402
from dtrain.parallel.packed import PackedColwiseParallel, row_exchange  # noqa: E402
from dtrain.parallel.tensor_plan import plan_of  # noqa: E402

KINDS = ("llama", "qwen2", "neox", "nanogpt")
TRAINED = ("nanogpt",)
"""Trained here under tensor against single; the Hugging Face models train in
tests/test_third_party.py's matrix (tensor, dp2 x tp2, pp2 x tp2), with their config's plan."""
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": LENGTH,
}
"""A tiny decoder: 4 heads (2 per rank), 2 key/value heads where the family has them."""


class FusedAttention(nn.Module):
    """nanoGPT's attention: one c_attn layer computes [q; k; v]. Its forward cuts the output
    into three (`chunk`) and reshapes by head size, so it also runs on a rank's packed
    rows, its own heads of q, k and v."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (
            part.view(n, t, -1, self.head_dim).transpose(1, 2)
            for part in self.c_attn(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(n, t, -1))


class NanoBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-shaped language model (fused c_attn, the head tied to the token
    embedding) computing its own loss from a dict batch."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(LENGTH, dim)
        self.h = nn.ModuleList(NanoBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.wte(input_ids) + self.wpe(
            torch.arange(input_ids.shape[1], device=input_ids.device)
        )
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        return {
            "h.*.attn.c_attn": "packed_colwise:3",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.0": "colwise",
            "h.*.mlp.2": "rowwise",
        }


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with eps 1e-6: the key bias of a fused [q; k; v] layer gets a gradient that is
    zero up to rounding (softmax ignores a bias added to every score of a query), which
    torch's eps 1e-8 would turn into steps of ~lr whatever its last digits; tensor
    parallelism sums in another order, so the comparison would be about rounding."""
    return torch.optim.AdamW(model.parameters(), eps=1e-6)


def build(kind: str) -> nn.Module:
    """A tiny model of `kind` (KINDS), the same on every call."""
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2))
    if kind == "qwen2":
        config = Qwen2Config(**SIZES, num_key_value_heads=2, tie_word_embeddings=True)
        return Qwen2ForCausalLM(config)
    if kind == "neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**SIZES, bos_token_id=0, eos_token_id=0))
    return NanoGPT()


def train_kind(
    kind: str, steps: int = 3, close: bool = True, checkpoint_out: str | None = None, **options: Any
) -> dict[str, torch.Tensor] | None:
    """Train `kind` for `steps` AdamW steps with the model's own loss under `options`; the
    parameters on the main rank. With `checkpoint_out`, save a checkpoint there."""
    engine = dtrain.init(seed=0, **options)
    model, optimizer = engine.setup(model := build(kind), adamw(model))
    loader = engine.dataloader(Tokens("gpt2"), global_batch_size=12)
    for batch in engine.progress(loader):
        engine.train_step(batch)
        if engine.step == steps:
            break
    if checkpoint_out:
        engine.save(checkpoint_out)
    del model, optimizer
    return finish(engine, close)


def tensor_runs(checkpoint: str) -> list[dict[str, torch.Tensor] | None]:
    """Every kind under tensor parallelism over 2 ranks, in one process group; the last
    saves a sharded checkpoint to `checkpoint`."""
    out = []
    for i, kind in enumerate(TRAINED):
        last = i == len(TRAINED) - 1
        saving = {"checkpoint_out": checkpoint, "checkpoint_format": "sharded"} if last else {}
        out.append(train_kind(kind, close=last, strategy="tensor", **saving))
    return out


# -- the plans, in one process --------------------------------------------------------------
def refuses(model: nn.Module, plan: dict[str, str], match: str, degree: int = 2) -> None:
    """`plan`, given as `model`'s own, is refused with a message matching `match`."""
    model.tensor_parallel_plan = lambda _: plan  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=match):
        plan_of(model, degree)


def test_hugging_face_configs_give_the_plan() -> None:
    llama = plan_of(build("llama"), 2)
    assert list(llama)[:2] == ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj"]
    head = llama["lm_head"]  # colwise_gather_output: split by vocabulary, logits gathered
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert isinstance(llama["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert "model.embed_tokens" not in llama
    # GPT-NeoX's fused layer interleaves heads ([h0: q, k, v][h1: ...]): a plain column
    # split gives whole heads, so the config's "colwise" stays.
    neox = plan_of(build("neox"), 2)
    qkv = neox["gpt_neox.layers.*.attention.query_key_value"]
    assert type(qkv) is ColwiseParallel
    embed = neox["gpt_neox.embed_in"]  # embedding_rowwise: vocabulary split, lookups summed
    assert isinstance(embed, RowwiseParallel) and embed.input_layouts == (Replicate(),)


def test_a_tied_head_splits_its_embedding_alike() -> None:
    model = build("qwen2")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = plan_of(model, 2)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)  # vocabulary, as the head
    refuses(model, {"lm_head": "colwise"}, "model.embed_tokens.weight and lm_head.weight are one")


def test_a_plan_of_your_own_wins_and_replicate_leaves_a_layer_whole() -> None:
    model = build("llama")
    model.tensor_parallel_plan = lambda degree: {
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise_split_input",
        "lm_head": "replicate",
    }
    plan = plan_of(model, 2)
    assert list(plan) == ["model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj"]
    assert plan["model.layers.*.mlp.down_proj"].input_layouts == (Replicate(),)


def test_heads_must_divide_by_the_degree() -> None:
    with pytest.raises(ConfigError, match=r"4 attention heads of LlamaForCausalLM .*--tp that"):
        plan_of(build("llama"), 3)
    with pytest.raises(ConfigError, match=r"2 key/value heads .*config.num_key_value_heads"):
        plan_of(build("llama"), 4)


def test_styles_dtrain_does_not_apply_are_refused_by_name() -> None:
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(MixtralConfig(**SIZES, num_key_value_heads=2, num_local_experts=2))
    with pytest.raises(ConfigError, match=r"model.layers.\*.mlp.experts the style 'moe_tp_exp.*"):
        plan_of(mixtral, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_plan\\(degree\\) method for the model"):
        plan_of(mixtral, 2)
    model = build("llama")
    refuses(model, {"model.norm": "sequence_parallel"}, "'sequence_parallel', which dtrain's")
    refuses(model, {"model.norm": "sequence_parallel"}, "Leave model.norm out of the plan")
    refuses(model, {"lm_head": "colwise_sideways"}, "Unknown tensor-parallel style 'colwise_si")


def test_packed_colwise_needs_its_part_count_and_a_fitting_layer() -> None:
    model = NanoGPT()
    plan = plan_of(model, 2)
    assert isinstance(plan["h.*.attn.c_attn"], PackedColwiseParallel)
    assert plan["h.*.attn.c_attn"].parts == 3
    qkv = "h.*.attn.c_attn"
    refuses(model, {qkv: "packed_colwise"}, "write 'packed_colwise:3' for a fused")
    refuses(model, {qkv: "packed_colwise:5"}, "96 output features, which cannot hold the 5 eq")
    refuses(model, {qkv: "packed_colwise:3"}, "96 output features in 3 packed parts of 32", 3)
    refuses(model, {"h.*.attn": "packed_colwise:3"}, "a FusedAttention, with packed_colwise")


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_row_exchange_gives_each_rank_its_slice_of_every_part(ranks: int) -> None:
    rows, parts = 24, 3
    blocks = torch.arange(rows).chunk(ranks)  # canonical rows by rank (Shard(0))
    exchanges = [row_exchange(rows, parts, ranks, r) for r in range(ranks)]
    sent = [
        blocks[j][e.order].split(e.send) for j, e in enumerate(exchanges)
    ]  # what rank j sends to each rank
    for r, exchange in enumerate(exchanges):
        got = torch.cat([sent[j][r] for j in range(ranks)])
        assert [len(sent[j][r]) for j in range(ranks)] == exchange.receive
        wanted = torch.cat([part.chunk(ranks)[r] for part in torch.arange(rows).chunk(parts)])
        assert torch.equal(got, wanted)


# -- training, against one process ----------------------------------------------------------
@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {kind: train_kind(kind, strategy="single") for kind in TRAINED}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tensor_plans") / "nanogpt"


@pytest.fixture(scope="module")
def tensor_params(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    results = run_ranks(tensor_runs, 2, str(checkpoint), timeout=400)[0]
    return dict(zip(TRAINED, results, strict=True))


@pytest.mark.timeout(450)
@pytest.mark.parametrize("kind", TRAINED)
def test_tensor_plans_train_as_single(
    kind: str,
    references: dict[str, dict[str, torch.Tensor]],
    tensor_params: dict[str, dict[str, torch.Tensor]],
) -> None:
    assert_close(tensor_params[kind], references[kind], atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(450)
def test_a_packed_layer_checkpoints_in_canonical_order(
    checkpoint: Path, tensor_params: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Saved sharded under tensor, the fused layer loads under single exactly."""
    engine = dtrain.init(strategy="single", seed=0)
    model, optimizer = engine.setup(model := build("nanogpt"), adamw(model))
    engine.load(checkpoint)
    del model, optimizer
    assert_close(finish(engine, True), tensor_params["nanogpt"], atol=0, rtol=0)
