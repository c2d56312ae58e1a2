"""Context parallelism (--cp): each sample's sequence cut over ranks, attention over the
whole of it. The bundled GPT trains to `single`'s parameters under ddp and zero3 with the
sequence cut in two, alone and beside data parallelism; what the cut cannot honour is
refused by name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from torch.testing import assert_close
from torch.utils.data import Dataset
from training import CLOSE

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig, lm_loss
from dtrain.parallel.degrees import degrees_for
from dtrain.parallel.hf_context import UNMASKED, attention_switch
from dtrain.strategies.specs import lookup

STEPS = 4
LENGTH = 64
CONFIG = GPTConfig(vocab_size=48, context=LENGTH, dim=32, layers=2, heads=4)
LAYOUTS_AT_2: list[dict[str, Any]] = [
    {"strategy": "ddp", "cp": 2},
    {"strategy": "zero3", "cp": 2},
    {"strategy": "ddp", "cp": 2, "model": "llama"},
    {"strategy": "zero3", "cp": 2, "model": "llama"},
    # Ignored targets (-100) in (inputs, targets) pairs: each rank's mean weighted by its
    # share of the scored targets.
    {"strategy": "ddp", "cp": 2, "masked": True},
    # Micro-batches of unequal label counts, each cut: weighted by labels twice over.
    {"strategy": "ddp", "cp": 2, "model": "llama", "grad_accumulation": 2},
    {"strategy": "zero1", "cp": 2},
    # Recomputed blocks attend again in backward, over the whole sequence.
    {"strategy": "zero3", "cp": 2, "activation_checkpointing": "full"},
]


class Prompted(Dataset):
    """Random token sequences as Hugging Face batches, ``{"input_ids", "labels"}``, the
    first 3 + i % 29 labels of sample i masked (-100): the context ranks of a sample hold
    different numbers of labels, which the mean over all of them must weigh."""

    def __init__(self) -> None:
        self.ids = Tokens().ids[:, :-1]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: 3 + i % 29] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def llama() -> torch.nn.Module:
    """A tiny Hugging Face Llama (grouped-query attention: 4 heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


class Tokens(Dataset):
    """Random token sequences as (inputs, targets) pairs, the targets shifted by one; with
    `masked`, the first 3 + i % 29 targets of sample i ignored (-100), as a prompt's."""

    def __init__(self, length: int = LENGTH, masked: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, CONFIG.vocab_size, (16, length + 1), generator=generator)
        self.masked = masked

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        targets = self.ids[i, 1:].clone()
        if self.masked:
            targets[: 3 + i % 29] = -100
        return self.ids[i, :-1], targets


def trained(layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's parameters after STEPS AdamW steps on global batches of 4 under `layout`
    (saved as a checkpoint under its "save" path, if it names one)."""
    layout = dict(layout)
    save = layout.pop("save", None)
    hf = layout.pop("model", "gpt") == "llama"
    length = layout.pop("length", LENGTH)
    masked = layout.pop("masked", False)
    engine = dtrain.init(seed=0, cpu=True, **layout)
    torch.manual_seed(0)
    model = llama() if hf else GPT(CONFIG)
    model, _ = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    data = Prompted() if hf else Tokens(length, masked)
    for batch in engine.dataloader(data, global_batch_size=4):
        engine.train_step(batch, None if hf else lm_loss)  # Llama: its own loss
        if engine.step == STEPS:
            break
    params = engine.state_dict()
    if save is not None:
        engine.save(save)
    engine.close()
    return params


def trained_each(layouts: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    return [trained(layout) for layout in layouts]


@pytest.mark.timeout(600)
def test_every_layout_with_the_sequence_cut_trains_as_single(tmp_path: Path) -> None:
    expected = {
        model: trained({"strategy": "single", "model": model}) for model in ("gpt", "llama")
    }
    expected["masked"] = trained({"strategy": "single", "masked": True})
    results = run_ranks(trained_each, 2, LAYOUTS_AT_2, timeout=280)
    for layout, got in zip(LAYOUTS_AT_2, results[0], strict=True):
        want = expected["masked" if layout.get("masked") else layout.get("model", "gpt")]
        assert_close(got, want, **CLOSE, msg=lambda m, o=layout: f"{o}: {m}")
    layouts = [
        {"strategy": "zero3", "cp": 2, "save": str(tmp_path / "ckpt")},
        {"strategy": "zero3", "cp": 2, "model": "llama"},
        {"strategy": "tensor", "cp": 2},  # tp2 x cp2: each rank's heads, over the sequence
        # Two replicas, each sharded over its 2 context ranks (a 2-D mesh, as across hosts).
        {"strategy": "hsdp", "cp": 2, "shard_size": 2},
    ]
    beside, hf_beside, sliced, hybrid = run_ranks(trained_each, 4, layouts, timeout=280)[0]
    assert_close(hybrid, expected["gpt"], **CLOSE, msg=lambda m: f"hsdp 2 x (1 x cp2): {m}")
    assert_close(beside, expected["gpt"], **CLOSE, msg=lambda m: f"zero3 dp2 x cp2: {m}")
    assert_close(hf_beside, expected["llama"], **CLOSE, msg=lambda m: f"llama dp2 x cp2: {m}")
    assert_close(sliced, expected["gpt"], **CLOSE, msg=lambda m: f"tensor tp2 x cp2: {m}")
    # dp 2 (sharded) x cp 2 x tp 2: FSDP over the (dp, cp) slice beside the tp slices.
    layout = {"strategy": "hybrid", "tp": 2, "cp": 2, "dp_mode": "zero3"}
    [every] = run_ranks(trained_each, 8, [layout], timeout=280)[0]
    assert_close(every, expected["gpt"], **CLOSE, msg=lambda m: f"hybrid dp2 x cp2 x tp2: {m}")
    # Three ranks: six chunks, (0, 5), (1, 4), (2, 3); sequences of 48 tokens.
    short = trained({"strategy": "single", "length": 48})
    [third] = run_ranks(trained_each, 3, [{"strategy": "ddp", "cp": 3, "length": 48}])[0]
    assert_close(third, short, **CLOSE, msg=lambda m: f"ddp cp3: {m}")
    # cp holds no shard of its own: the checkpoint loads whole into one process.
    engine = dtrain.init(strategy="single", cpu=True)
    model, _ = engine.setup(GPT(CONFIG))
    engine.load(tmp_path / "ckpt")
    assert_close(dict(model.state_dict()), beside, rtol=0, atol=0)
    engine.close()


class HandAttention(torch.nn.Module):
    """Positions taken, but attention computed by hand (no F.scaled_dot_product_attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(CONFIG.vocab_size, 8)
        self.head = torch.nn.Linear(8, CONFIG.vocab_size)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> Any:
        x = self.embed(tokens)
        scores = (x @ x.transpose(1, 2)).softmax(-1)
        return self.head(scores @ x)


def refusals() -> list[str]:
    """What --cp 2 refuses, by message, in the order tried."""
    said = []

    def attempt(action: Any) -> None:
        try:
            action()
        except (ConfigError, dtrain.SetupError) as e:
            said.append(str(e))
        else:
            said.append("")

    ids = Tokens().ids[:4]
    engine = dtrain.init(strategy="ddp", cp=2, cpu=True)
    gpt = GPT(CONFIG)
    model, _ = engine.setup(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1))
    attempt(lambda: engine.train_step((ids[:, :61], ids[:, 1:62]), lm_loss))
    padded = {"input_ids": ids[:, :-1], "attention_mask": torch.ones_like(ids[:, :-1])}
    attempt(lambda: engine.train_step(padded))
    attempt(lambda: engine.train_step((ids[:, :-1], ids[:, 0]), lm_loss))
    attempt(lambda: model(ids[:, :-1]))  # a loop by hand
    attempt(lambda: engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 0]}))
    attempt(lambda: engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, lm_loss))
    engine.close()
    attempt(lambda: gpt.train()(ids[:, :-1]))  # closed: the model is the user's again
    engine = dtrain.init(strategy="ddp", cp=2, cpu=True)
    hand = HandAttention()
    engine.setup(hand, torch.optim.SGD(hand.parameters(), lr=0.1))
    mine = (ids[:, :-1] + engine.rank) % CONFIG.vocab_size  # a loader sharded by global rank
    attempt(lambda: engine.train_step((mine, ids[:, 1:]), lm_loss))
    attempt(lambda: engine.train_step((ids[:, :-1], ids[:, 1:]), lm_loss))
    engine.close()
    engine = dtrain.init(strategy="zero3", cp=2, cpu=True)
    attempt(lambda: engine.setup(torch.nn.Sequential(torch.nn.Embedding(4, 4))))
    engine.close()
    return said


def compiled_refusal() -> str:
    """What --cp 2 says to a model passed in compiled."""
    engine = dtrain.init(strategy="ddp", cp=2, cpu=True)
    with pytest.raises(ConfigError) as refused:
        engine.setup(torch.compile(GPT(CONFIG)))
    engine.close()
    return str(refused.value)


@pytest.mark.timeout(200)
def test_what_the_cut_cannot_honour_is_refused_by_name() -> None:
    said = run_ranks(refusals, 2, timeout=180)
    assert said[0] == said[1]
    expected = [
        r"into 4 equal chunks, which a sequence of 61 tokens does not divide",
        r"the batch's attention_mask would describe the whole sequence \(or padding",
        r"cuts the sequence \(dimension 1\) of the inputs and targets alike",
        r"a forward of the model outside it would attend within",
        r"labels \(4,\) are not one per token of input_ids \(4, 64\)",
        r"a loss that shifts them would pair tokens across the cut",
        r"^$",
        r"The 2 context ranks of a sample hold different batches \(4 x 64, 4 x 64",
        r"HandAttention's forward never called torch.nn.functional.scaled_dot_product_attention",
        r"Sequential.forward takes no position_ids argument",
    ]
    assert len(said[0]) == len(expected)
    for message, pattern in zip(said[0], expected, strict=True):
        assert re.search(pattern, message), (pattern, message)
    compiled = run_ranks(compiled_refusal, 2, timeout=120)[0]
    assert "pass the model to engine.setup uncompiled with --cp" in compiled


def test_layouts_without_the_cut_are_refused_before_launch() -> None:
    with pytest.raises(ConfigError, match=r"--cp 2 cuts .* which --strategy towers does not do"):
        dtrain.init(strategy="towers", cp=2)
    with pytest.raises(ConfigError, match=r"--cp must be at least 1, got 0"):
        dtrain.init(strategy="ddp", cp=0)
    with pytest.raises(ConfigError, match=r"drop --compile with --cp"):
        dtrain.init(strategy="ddp", cp=2, compile=True)
    with pytest.raises(ConfigError, match=r"--cp 2 cuts .* which --strategy pipeline does not"):
        dtrain.init(strategy="pipeline", cp=2)
    with pytest.raises(ConfigError, match=r"a pipeline's stages cannot pass on cut"):
        degrees_for("hybrid", 8, None, 2, 2, "zero3", 2)
    with pytest.raises(ConfigError, match=r"use --dp-mode zero2 or zero3"):
        degrees_for("hybrid", 8, None, None, 2, "ddp", 2)
    with pytest.raises(ConfigError, match=r"--cp 2 does not divide the 3 processes"):
        lookup("ddp").layout(Config(strategy="ddp", cp=2), 3)  # type: ignore[attr-defined]


def test_a_hugging_face_model_attending_otherwise_than_by_sdpa_is_refused() -> None:
    model = llama()
    model.config._attn_implementation = "eager"  # its own matmuls: nothing to cut
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM attends with 'eager'"):
        attention_switch(model)
    model.config._attn_implementation = "sdpa"
    model.config.sliding_window = 16  # Mistral's habit: a band --cp cannot honour
    with pytest.raises(ConfigError, match=r"within a sliding window of 16 tokens"):
        attention_switch(model)
    model.config.sliding_window = None
    with attention_switch(model)():  # a step: transformers builds no mask
        assert model.config._attn_implementation == UNMASKED
    assert model.config._attn_implementation == "sdpa"
