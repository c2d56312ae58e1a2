"""Models we did not write split into pipeline stages as they are: Hugging Face causal LMs
by their own pp plan (no pipeline_layers(), dict batches, the model's own loss),
torchtitan's own decoder by the layout its forward promises, and a decoder in
torchtitan's older layout (blocks in a ModuleDict named ``layers``, each given a complex
rotary table the model holds at its root). None of the names a model may use collides
with a stage's own."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from titan_like import TitanLike
from torch import nn
from torch.testing import assert_close
from torch.utils.data import Dataset
from training import finish

import dtrain
from dtrain.errors import ConfigError, SetupError
from dtrain.parallel.hf_pipeline import hf_feed
from dtrain.parallel.pipeline import PipelineModel
from dtrain.parallel.split import Stage, layers_of, layout_of, split_layers
from dtrain.parallel.stage_checks import check_stages
from dtrain.step.batches import pipeline_parts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import (  # noqa: E402
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

VOCAB, LENGTH, SAMPLES, BATCH = 64, 12, 48, 8
KINDS = ("llama", "qwen2", "neox", "titan")
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
}
CLASHING = ["layers", "paths", "layer_names", "model_names", "local", "pipeline", "roots",
            "model", "chain", "layout", "feed"]  # fmt: skip
"""Names of the attributes dtrain's stages had or might have; a model may use any."""


def build(kind: str) -> nn.Module:
    """A tiny model of `kind`, the same on every call (no dropout)."""
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **COMMON))
    if kind == "qwen2":
        return Qwen2ForCausalLM(
            Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **COMMON)
        )
    if kind == "qwen2-sliding":  # its second and third layers see 4 tokens back
        sliding = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **sliding, **COMMON))
    if kind == "neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**COMMON))
    model = TitanLike()
    model.init_weights()
    return model


class Tokens(Dataset):
    """Random token sequences as their own labels; with `padded`, an attention mask that
    pads the end of every third sequence, left out of the loss (Llama's batches)."""

    def __init__(self, padded: bool) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.padded = padded

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.ids[i], "labels": self.ids[i]}
        if self.padded:
            mask = (torch.arange(LENGTH) < LENGTH - 4 * (i % 3 == 0)).long()
            item["attention_mask"] = mask
            item["labels"] = self.ids[i].masked_fill(mask == 0, -100)
        return item


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for the torchtitan-like model."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def train(
    kind: str,
    steps: int = 3,
    close: bool = True,
    save: str | None = None,
    **options: Any,
) -> dict[str, Any] | None:
    """`steps` AdamW steps of `kind` on dict batches (the torchtitan-like model on
    (inputs, targets) pairs), saving `save` at the end, then an evaluation; on the main
    rank, the parameters and buffers (canonical names) and the evaluation loss."""
    engine = dtrain.init(seed=0, **options)
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    data = Tokens(padded=kind == "llama")
    for batch in engine.dataloader(data, global_batch_size=BATCH):
        if kind == "titan":
            engine.train_step((batch["input_ids"], batch["labels"]), shifted_loss)
        else:
            engine.train_step(batch)  # model(**batch); the loss is the model's own
        if engine.step == steps:
            break
    if save:
        engine.save(save)
    evaluation = [{k: torch.stack([data[i][k] for i in range(BATCH)]) for k in data[0]}]
    if kind == "titan":
        loss = engine.evaluate([(b["input_ids"], b["labels"]) for b in evaluation], shifted_loss)
    else:
        loss = engine.evaluate(evaluation)
    del model, optimizer
    params = finish(engine, close)
    return None if params is None else {"params": params, "eval": loss["loss"]}


def pipeline_variants(root: str) -> list[dict[str, Any] | None]:
    """Every kind under a 2-stage pipeline, one after the other in this process group;
    the torchtitan-like model with its blocks checkpointed, saving a sharded checkpoint
    under `root`."""
    options: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
    options["titan"] = {
        "activation_checkpointing": "full",
        "checkpoint_format": "sharded",
        "save": f"{root}/titan",
    }
    last = len(KINDS) - 1
    return [
        train(k, close=i == last, strategy="pipeline", **options[k]) for i, k in enumerate(KINDS)
    ]


def loaded(kind: str, path: str) -> dict[str, torch.Tensor] | None:
    """The parameters and buffers of `kind` loaded from `path` under single."""
    engine = dtrain.init(seed=0, strategy="single")
    engine.setup(build(kind), None)
    engine.load(path)
    return finish(engine, True)


def _own_names(module: nn.Module, hosted: set[str]) -> set[str]:
    """The names `module` answers to that a plain module does not, but for the `hosted`
    modules of the user's model."""
    plain = nn.Module()
    return {n for n in dir(module) if not hasattr(plain, n)} - hosted


def test_no_name_of_ours_collides_with_a_models() -> None:
    """A stage and the model engine.setup returns keep their own state under dtrain's
    prefix, so a model whose top-level children bear every other name splits."""
    stage = Stage([("a", nn.Linear(2, 2))])
    wrapper = PipelineModel(stage, pipeline=None)  # type: ignore[arg-type]
    ours = _own_names(stage, {"a"}) | _own_names(wrapper, set())
    assert ours and all(n.startswith("_dtrain_") for n in ours), ours
    names = sorted(set(CLASHING) | {n.removeprefix("_dtrain_") for n in ours})
    model = nn.Sequential(OrderedDict((n, nn.Linear(4, 4)) for n in names))
    stages = [Stage(g, model) for g in split_layers(layers_of(model), 3, None)]
    assert check_stages(model, stages, 3) == []
    x = y = torch.randn(2, 4)
    for stage in stages:
        y = stage(y)
    assert_close(y, model(x))
    assert [k for s in stages for k in s.state_dict()] == list(model.state_dict())
    whole = Stage(layers_of(model), model)
    assert set(PipelineModel(whole, pipeline=None).state_dict()) == {  # type: ignore[arg-type]
        f"_dtrain_local.{k}" for k in model.state_dict()
    }


@pytest.mark.parametrize("kind", ["llama", "qwen2", "neox", "qwen2-sliding"])
def test_the_pp_plan_chain_is_the_models_forward_and_loss(kind: str) -> None:
    """Embeddings, decoder layers (given rotary embeddings and the causal mask, padding
    included, or the sliding window its config names for the layer), final norm and head,
    cut in two, give the model's own logits and loss;
    the stages hold the model's names, each stage running decoder layers its rotary
    table, and a tied head is found as a tie."""
    model = build(kind)
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    stages = [Stage(g, model) for g in split_layers(layers_of(model), 2, None)]
    ties = check_stages(model, stages, 2)
    feed = hf_feed(model)
    for extras in ({}, {"attention_mask": mask}):
        reference = model(input_ids=ids, labels=ids, **extras)
        inputs, targets, given, loss_fn = pipeline_parts(
            {"input_ids": ids, "labels": ids, **extras}, None, feed
        )
        x = inputs
        for stage in stages:
            x = stage(x, **given)
        assert loss_fn is not None and targets is not None
        assert_close(x, reference.logits)
        assert_close(loss_fn(x, targets), reference.loss)
    prefix = model.base_model_prefix
    names = [list(s.state_dict()) for s in stages]
    assert f"{prefix}.layers.0.post_attention_layernorm.weight" in names[0]
    assert "lm_head.weight" in names[1]
    assert {k for n in names for k in n} == set(model.state_dict())
    for stage in stages:
        assert f"{prefix}.rotary_emb.inv_freq" in dict(stage.named_buffers())
    assert [t.names for t in ties] == (
        [{0: f"{prefix}.embed_tokens.weight", 1: "lm_head.weight"}] if kind == "qwen2" else []
    )


def test_a_root_table_follows_its_stage() -> None:
    """torchtitan's layout: the blocks in ``layers``, each given the model's rotary table;
    each stage holds the table under the model's name, and its wrappers and the model read
    the stage's own tensor once the stage is moved or cast."""
    model = build("titan")
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    stages = [Stage(g, model) for g in split_layers(layers_of(model), 2, None)]
    assert check_stages(model, stages, 2) == []
    assert [layout_of(s).layer_names[0] for s in stages] == ["tok_embeddings", "layers.2"]
    x = ids
    for stage in stages:
        assert stage.freqs_cis is model.freqs_cis and "freqs_cis" in stage.state_dict()
        x = stage(x)
    assert_close(x, model(ids))
    table = model.freqs_cis
    stages[1].to_empty(device="cpu")  # new tensors in place of the stage's
    held = stages[1].get_buffer("freqs_cis")
    assert held is not table
    assert all(getattr(m, a) is held for m, a, _ in layout_of(stages[1]).roots)
    assert model.freqs_cis is held


def test_torchtitans_own_decoder_is_read_as_its_forward_promises() -> None:
    """torchtitan's Llama3, no code written for dtrain: embeddings, ``layers`` (each block
    given no masks and no positions, as its forward on tokens gives them), norm and head;
    a subclass with a forward of its own is refused by name."""
    pytest.importorskip("torchtitan.models.llama3")
    from third_party import LENGTH as CONTEXT
    from third_party import titan_llama3

    torch.manual_seed(0)
    model = titan_llama3()
    model.init_states()
    ids = torch.randint(0, VOCAB, (2, CONTEXT))
    stages = [Stage(g, model) for g in split_layers(layers_of(model), 2, None)]
    assert check_stages(model, stages, 2) == []
    assert [n for s in stages for n in layout_of(s).layer_names] == [
        "tok_embeddings", "layers.0", "layers.1", "norm", "lm_head"
    ]  # fmt: skip
    x = ids
    for stage in stages:
        x = stage(x)
    assert_close(x, model(ids))

    class Own(type(model)):  # type: ignore[misc]
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return super().forward(tokens)

    model.__class__ = Own
    with pytest.raises(ConfigError, match=r"\(Own.forward\) is its own.* pipeline_layers"):
        layers_of(model)


class _AddPositions(nn.Module):
    """A wrapper holding its model's root parameter (ViT's ``pos_embed`` habit)."""

    def __init__(self, embed: nn.Module, pos_embed: nn.Parameter) -> None:
        super().__init__()
        self.embed, self.pos_embed = embed, pos_embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) + self.pos_embed


class PositionsAtRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(4, 8))
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        return [("embed", _AddPositions(self.embed, self.pos_embed)), ("head", self.head)]


def test_what_a_pipeline_cannot_honour_is_refused_by_name() -> None:
    feed = hf_feed(build("llama"))
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(SetupError, match="'use_cache', which it cannot honour"):
        pipeline_parts({"input_ids": ids, "labels": ids, "use_cache": True}, None, feed)
    with pytest.raises(SetupError, match="lacks 'labels'"):
        pipeline_parts({"input_ids": ids}, None, feed)
    with pytest.raises(SetupError, match="without a loss_fn"):
        pipeline_parts({"input_ids": ids, "labels": ids}, shifted_loss, feed)
    with pytest.raises(SetupError, match="needs an \\(inputs, targets\\) batch"):
        pipeline_parts({"input_ids": ids, "labels": ids}, None, None)
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(num_key_value_heads=2, **COMMON))
    with pytest.raises(ConfigError, match="model_type 'mistral'.* pipeline_layers"):
        layers_of(mistral)
    with pytest.raises(ConfigError, match="nor is it a Hugging Face model with a pipeline plan"):
        layers_of(nn.Module())
    with pytest.raises(ConfigError, match="root parameter\\(s\\) pos_embed as its own"):
        Stage(layers_of(positions := PositionsAtRoot()), positions)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any] | None]:
    return {kind: train(kind, strategy="single") for kind in KINDS}


@pytest.mark.timeout(420)
def test_models_we_did_not_write_train_under_a_pipeline_as_single(
    references: dict[str, dict[str, Any] | None], tmp_path: Path
) -> None:
    """Llama (padded batches), Qwen2 (tied head), GPT-NeoX and the torchtitan-like decoder
    (activation checkpointing), two stages, 3 AdamW steps: the parameters and buffers, and
    the evaluation loss, are single's; the rotary table both stages hold is saved once
    and loads under single."""
    results = run_ranks(pipeline_variants, 2, str(tmp_path), timeout=400)[0]
    for kind, result in zip(KINDS, results, strict=True):
        reference = references[kind]
        assert result is not None and reference is not None
        msg = lambda m, k=kind: f"pipeline, {k}: {m}"  # noqa: E731
        assert_close(result["params"], reference["params"], atol=1e-4, rtol=1e-4, msg=msg)
        assert_close(result["eval"], reference["eval"], atol=1e-4, rtol=1e-4, msg=msg)
    qwen = results[1]["params"]
    assert_close(qwen["lm_head.weight"], qwen["model.embed_tokens.weight"])
    assert_close(loaded("titan", str(tmp_path / "titan")), results[3]["params"])
