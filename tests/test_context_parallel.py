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
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig, lm_loss

STEPS = 4
LENGTH = 64
CONFIG = GPTConfig(vocab_size=48, context=LENGTH, dim=32, layers=2, heads=4)
LAYOUTS_AT_2: list[dict[str, Any]] = [
    {"strategy": "ddp", "cp": 2},
    {"strategy": "zero3", "cp": 2},
]


class Tokens(Dataset):
    """Random token sequences as (inputs, targets) pairs, the targets shifted by one."""

    def __init__(self, length: int = LENGTH) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, CONFIG.vocab_size, (16, length + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


def trained(layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's parameters after STEPS AdamW steps on global batches of 4 under `layout`
    (saved as a checkpoint under its "save" path, if it names one)."""
    layout = dict(layout)
    save = layout.pop("save", None)
    engine = dtrain.init(seed=0, cpu=True, **layout)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model, _ = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    for batch in engine.dataloader(Tokens(), global_batch_size=4):
        engine.train_step(batch, lm_loss)
        if engine.step == STEPS:
            break
    params = engine.state_dict()
    if save is not None:
        engine.save(save)
    engine.close()
    return params


def trained_each(layouts: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    return [trained(layout) for layout in layouts]


@pytest.mark.timeout(300)
def test_the_sequence_cut_over_two_ranks_trains_as_single(tmp_path: Path) -> None:
    expected = trained({"strategy": "single"})
    results = run_ranks(trained_each, 2, LAYOUTS_AT_2, timeout=280)
    for layout, got in zip(LAYOUTS_AT_2, results[0], strict=True):
        assert_close(got, expected, **CLOSE, msg=lambda m, o=layout: f"{o}: {m}")
    layout = {"strategy": "zero3", "cp": 2, "save": str(tmp_path / "ckpt")}
    [beside] = run_ranks(trained_each, 4, [layout], timeout=280)[0]
    assert_close(beside, expected, **CLOSE, msg=lambda m: f"zero3 dp2 x cp2: {m}")
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
    attempt(lambda: engine.train_step({"input_ids": ids[:, :-1]}))
    attempt(lambda: engine.train_step((ids[:, :-1], ids[:, 0]), lm_loss))
    attempt(lambda: model(ids[:, :-1]))  # a loop by hand
    engine.close()
    engine = dtrain.init(strategy="ddp", cp=2, cpu=True)
    hand = HandAttention()
    engine.setup(hand, torch.optim.SGD(hand.parameters(), lr=0.1))
    attempt(lambda: engine.train_step((ids[:, :-1], ids[:, 1:]), lm_loss))
    engine.close()
    engine = dtrain.init(strategy="zero3", cp=2, cpu=True)
    attempt(lambda: engine.setup(torch.nn.Sequential(torch.nn.Embedding(4, 4))))
    engine.close()
    return said


@pytest.mark.timeout(200)
def test_what_the_cut_cannot_honour_is_refused_by_name() -> None:
    said = run_ranks(refusals, 2, timeout=180)
    assert said[0] == said[1]
    expected = [
        r"into 4 equal chunks, which a sequence of 61 tokens does not divide",
        r"--cp cuts \(inputs, targets\) batches of token sequences; this batch is a dict",
        r"cuts the sequence \(dimension 1\) of the inputs and targets alike",
        r"a forward of the model outside it would attend within",
        r"HandAttention's forward never called torch.nn.functional.scaled_dot_product_attention",
        r"Sequential.forward takes no position_ids argument",
    ]
    assert len(said[0]) == len(expected)
    for message, pattern in zip(said[0], expected, strict=True):
        assert re.search(pattern, message), (pattern, message)


def test_layouts_without_the_cut_are_refused_before_launch() -> None:
    with pytest.raises(ConfigError, match=r"--cp 2 cuts .* which --strategy tensor does not do"):
        dtrain.init(strategy="tensor", cp=2)
    with pytest.raises(ConfigError, match=r"--cp must be at least 1, got 0"):
        dtrain.init(strategy="ddp", cp=0)
