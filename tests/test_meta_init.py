"""A model built without memory (`engine.init_empty`) starts as the model built whole with
the same seed and trains like it under every strategy; one that cannot be initialised is
refused by name; and a model built whole is placed shard by shard under zero3. Models of other
projects' habits, in one process: tests/test_meta_init_models.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from distributed import run_ranks
from test_meta_init_models import hf_model, start
from torch import nn
from torch.testing import assert_close
from training import CLOSE, finish

import dtrain
import dtrain.parallel.data_parallel as data_parallel
from dtrain.datasets import load_text
from dtrain.errors import SetupError
from dtrain.models.gpt import GPT, SIZES, lm_loss

STEPS = 3
BATCH = 12


class TiedLM(nn.Module):
    """nanoGPT's habits: an output layer tied to the embedding and a constructor that ends
    by re-initialising every weight itself (`init_weights`), with a scaled projection."""

    def __init__(self, vocab: int = 256, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.embed.weight = self.head.weight
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, 0.02) weights, zero biases, the projection scaled down."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, T) token ids -> (N, T, vocab) logits."""
        x = self.embed(tokens)
        return self.head(self.ln(x + self.proj(x)))


def build(name: str) -> nn.Module:
    return TiedLM() if name == "tied" else GPT(SIZES["tiny"])


def run(strategy: str, empty: bool, model_name: str = "gpt", close: bool = True, **options: Any):
    """(parameters after setup, after STEPS steps) of `model_name` built whole or inside
    `engine.init_empty()`, on the main rank (None elsewhere), and numbers drawn from torch's
    generator after setup (a whole build has advanced it)."""
    engine = dtrain.init(strategy=strategy, seed=0, **options)
    if empty:
        with engine.init_empty():
            model = build(model_name)
    else:
        model = build(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = engine.setup(model, optimizer)
    drawn = torch.rand(3)
    initial = engine.state_dict()
    train_set, _ = load_text(context=64)
    loader = engine.dataloader(train_set, batch_size=BATCH // engine.dp_size)
    for batch in engine.progress(loader):
        engine.train_step(batch, lm_loss)
        if engine.step == STEPS:
            break
    del model, optimizer
    return initial, finish(engine, close), drawn


def hf_start(strategy: str) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor]:
    """The parameters after setup (main rank) of the tiny Qwen2 (tied embeddings) built
    inside `engine.init_empty()` under `strategy`, and numbers drawn after setup; the
    process group is kept for another run."""
    engine = dtrain.init(strategy=strategy, seed=0)
    with engine.init_empty():
        model = hf_model("qwen2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = engine.setup(model, optimizer)
    drawn = torch.rand(4)
    del model, optimizer
    return finish(engine, close=False), drawn


def empty_runs(variants: list[dict[str, Any]]) -> tuple[list[Any], Any, Any]:
    """Each of `variants` (options of `run`) in turn in this process group, Qwen2 under
    zero3 (`hf_start`), then `sharding_held_bytes` (one spawned job for all)."""
    runs = [run(empty=True, close=False, **v) for v in variants]
    return runs, hf_start("zero3"), sharding_held_bytes()


@pytest.fixture(scope="module")
def whole() -> dict[str, Any]:
    """Single-process runs of the models built whole."""
    return {name: run("single", empty=False, model_name=name) for name in ("gpt", "tied")}


def test_single_builds_empty_models_as_whole_ones(whole: dict[str, Any]) -> None:
    for name in ("gpt", "tied"):
        initial, final, drawn = run("single", empty=True, model_name=name)
        assert_close(initial, whole[name][0], rtol=0, atol=0)
        assert_close(final, whole[name][1], rtol=0, atol=0)
        assert_close(drawn, whole[name][2], rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_every_layout_initialises_its_part_as_the_whole_model_and_zero3_places_shards(
    whole: dict,
) -> None:
    variants: list[dict[str, Any]] = [
        {"strategy": "ddp"},
        {"strategy": "zero3"},
        {"strategy": "zero3", "model_name": "tied"},
        {"strategy": "pipeline", "schedule": "gpipe", "microbatches": 2},
        {"strategy": "tensor"},
    ]
    results = run_ranks(empty_runs, 2, variants, timeout=220)
    for variant, (initial, final, drawn) in zip(variants, results[0][0], strict=True):
        expected = whole[variant.get("model_name", "gpt")]
        label = str(variant)
        assert_close(initial, expected[0], rtol=0, atol=0, msg=lambda m, s=label: f"{s}: {m}")
        assert_close(final, expected[1], **CLOSE, msg=lambda m, s=label: f"{s}: {m}")
        assert_close(drawn, expected[2], rtol=0, atol=0, msg=lambda m, s=label: f"{s}: {m}")
    # A Hugging Face model whose sub-model initialises itself (post_init), sharded as built.
    hf_initial, hf_drawn = results[0][1]
    hf_whole, hf_whole_drawn = start(lambda: hf_model("qwen2"), empty=False)
    assert hf_initial and hf_initial.keys() <= hf_whole.keys()
    assert_close(hf_initial, {k: hf_whole[k] for k in hf_initial}, rtol=0, atol=0)
    assert_close(hf_drawn, hf_whole_drawn, rtol=0, atol=0)
    # zero3 with a model built whole: placed block by block as it is sharded.
    for _, _, (held, after, moved) in results:
        assert not moved  # the whole model never went to the device before sharding
        assert len(held) == SIZES["tiny"].layers + 1  # each block, then the root
        assert held == [0] * len(held)  # a sharded block's whole tensors were let go
        assert after == 0


class Scale(nn.Module):
    """A module with a parameter of its own and no way to initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class HalfReset(nn.Linear):
    """A reset_parameters() that forgets the bias."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def test_a_module_that_cannot_be_initialised_is_refused_by_name() -> None:
    engine = dtrain.init(strategy="single")
    with engine.init_empty():
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(SetupError, match=r"Module '1' \(Scale\).*gain.*reset_parameters"):
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.close()
    engine = dtrain.init(strategy="single")
    with engine.init_empty():
        model = nn.Sequential(HalfReset(4, 4))
    with pytest.raises(SetupError, match=r"module '0' \(HalfReset\).*left 'bias' unset"):
        engine.setup(model)
    engine.close()


def sharding_held_bytes() -> tuple[list[int], int, bool]:
    """Under zero3, with the script holding its parameters (as its optimizer does through
    setup): the elements of whole parameters still held for blocks already sharded, at
    each `fully_shard` call; those held after setup; and whether the model was moved to
    the device whole before sharding."""
    real = data_parallel.fully_shard
    engine = dtrain.init(strategy="zero3", seed=0)
    model = GPT(SIZES["tiny"])
    originals = list(model.parameters())
    sizes = {id(p): p.numel() for p in originals}
    sharded: set[int] = set()
    held: list[int] = []

    def whole_held(ids: set[int]) -> int:
        return sum(p.numel() for p in originals if id(p) in ids and p.numel() == sizes[id(p)])

    def spy(module: nn.Module, **kwargs: Any) -> nn.Module:
        held.append(whole_held(sharded))
        sharded.update(id(p) for p in module.parameters() if id(p) in sizes)
        return real(module, **kwargs)

    moved: list[bool] = []
    placing = type(model).to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        moved.append(True)
        return placing(self, *args, **kwargs)

    data_parallel.fully_shard = spy  # type: ignore[assignment]
    type(model).to = to  # type: ignore[method-assign]
    try:
        engine.setup(model, torch.optim.AdamW(originals, lr=1e-3))
    finally:
        data_parallel.fully_shard = real
        type(model).to = placing  # type: ignore[method-assign]
    after = whole_held(set(sizes))
    del model
    engine.close()
    return held, after, bool(moved)
