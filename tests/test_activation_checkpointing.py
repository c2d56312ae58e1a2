"""--activation-checkpointing: the same model trained with less activation memory.

Every strategy trains a GPT with dropout to the same parameters with `full` and `selective`
checkpointing as without (the recomputation draws the same dropout masks); a forward keeps
fewer bytes for backward; checkpoints keep their names and cross between runs with and
without it; what cannot be recomputed faithfully is refused by name.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from test_ps import run_ps
from torch import nn
from torch.testing import assert_close
from training import CLOSE, GLOBAL_BATCH, finish, train

import dtrain
from dtrain.datasets import load_text
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, Block, GPTConfig, lm_loss
from dtrain.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    is_checkpointed,
)
from dtrain.parallel.preparation import Preparation

SMALL = GPTConfig(context=16, dim=32, layers=4, heads=2)
"""Four blocks: `selective` checkpoints two of them, and two pipeline stages hold some."""
DROPOUT = 0.2
STEPS = 3


class DropoutBlock(Block):
    """The GPT block with dropout on both residual branches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), DROPOUT, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), DROPOUT, self.training)


def dropout_gpt() -> GPT:
    """The small GPT whose blocks apply dropout."""
    model = GPT(SMALL)
    model.blocks = nn.ModuleList(DropoutBlock(SMALL) for _ in range(SMALL.layers))
    return model


def train_dropout_gpt(mode: str, close: bool = True, **options: Any) -> Any:
    """(parameters, blocks checkpointed) after STEPS AdamW steps of the dropout GPT under
    `options` with --activation-checkpointing `mode`; (None, count) off the main rank."""
    engine = dtrain.init(seed=0, activation_checkpointing=mode, **options)
    model = dropout_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = engine.setup(model, optimizer)
    checkpointed = sum(is_checkpointed(b) for b in engine.module.blocks)
    train_set, _ = load_text(context=SMALL.context)
    loader = engine.dataloader(train_set, batch_size=GLOBAL_BATCH // engine.dp_size)
    for batch in engine.progress(loader, epoch=0):
        engine.train_step(batch, lm_loss)
        if engine.step == STEPS:
            break
    del model, optimizer
    return finish(engine, close), checkpointed


VARIANTS: list[dict[str, Any]] = [
    {"strategy": strategy, "mode": mode}
    for strategy, modes in (
        ("ddp", ("none", "full")),
        ("zero3", ("none", "full", "selective")),
        ("pipeline", ("none", "full", "selective")),
        ("tensor", ("none", "full")),
    )
    for mode in modes
]


def train_variants_ac(variants: list[dict[str, Any]]) -> list[Any]:
    """`train_dropout_gpt` for each variant, one after the other in this process group."""
    last = len(variants) - 1
    return [train_dropout_gpt(close=i == last, **v) for i, v in enumerate(variants)]


def assert_same_training(results: list[tuple[Any, int]], labels: list[str]) -> None:
    """Each run with checkpointing (full: 4 blocks, selective: 2) equals the run before
    it without (none: 0 blocks)."""
    expected = {"none": 0, "full": SMALL.layers, "selective": SMALL.layers // 2}
    reference = None
    for (params, checkpointed), label in zip(results, labels, strict=True):
        assert checkpointed == expected[label.split()[-1]], label
        if label.endswith("none"):
            reference = params
        else:
            assert_close(params, reference, **CLOSE, msg=lambda m, s=label: f"{s}: {m}")


@pytest.mark.parametrize("options", [{"strategy": "single"}, {"strategy": "towers", "towers": 2}])
def test_one_process_strategies_train_the_same_with_dropout(options: dict) -> None:
    modes = ["none", "full", "selective"]
    results = [train_dropout_gpt(mode, **options) for mode in modes]
    assert_same_training(results, [f"{options['strategy']} {mode}" for mode in modes])


@pytest.mark.timeout(240)
def test_mesh_strategies_train_the_same_with_dropout() -> None:
    results = run_ranks(train_variants_ac, 2, VARIANTS, timeout=220)[0]
    assert_same_training(results, [f"{v['strategy']} {v['mode']}" for v in VARIANTS])


@pytest.mark.timeout(120)
def test_ps_with_full_checkpointing_trains_as_single() -> None:
    """Sync ps (one worker, one server) matches single, checkpointing or not."""
    reference = train(steps=STEPS, strategy="single", model_name="gpt")
    trained = run_ps(1, 1, steps=STEPS, model_name="gpt", activation_checkpointing="full")[0]
    assert_close(trained, reference, **CLOSE)


def saved_bytes(plain: nn.Module, mode: str, compiled: bool = False) -> int:
    """Bytes of the tensors one training forward keeps for backward, of a copy of `plain`
    checkpointed with `mode` (and compiled as --compile does, with aot_eager: traced as
    inductor traces, not code-generated)."""
    model = copy.deepcopy(plain)
    Preparation(mode, None, compiled, "aot_eager").finish(model)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, SMALL.vocab_size, (4, SMALL.context))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return total


def test_checkpointing_keeps_fewer_activations_and_the_same_names() -> None:
    plain = dropout_gpt()
    sizes = {mode: saved_bytes(plain, mode) for mode in ("none", "selective", "full")}
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    assert saved_bytes(plain, "full", compiled=True) < saved_bytes(plain, "none", compiled=True)
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, "full")
    assert list(model.state_dict()) == list(plain.state_dict())
    # A copy recomputes its own blocks (its parameters, not the original's).
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(b) and b.forward.__self__ is b for b in twin.blocks)


def test_checkpoints_cross_between_runs_with_and_without(tmp_path: Path) -> None:
    """A checkpoint saved with checkpointing resumes without it and the other way round,
    both equal to uninterrupted training (parameters and optimizer state by name)."""
    gpt = {"model_name": "gpt", "strategy": "single"}
    uninterrupted = train(steps=4, **gpt)
    for saving, loading in (("full", "none"), ("none", "selective")):
        path = str(tmp_path / saving)
        train(steps=2, checkpoint_out=path, activation_checkpointing=saving, **gpt)
        resumed = train(steps=2, checkpoint_in=path, activation_checkpointing=loading, **gpt)
        assert_close(resumed, uninterrupted, **CLOSE)


class Norms(nn.Module):
    """Two blocks with BatchNorm, whose running statistics a recomputation would update."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="none, full, selective"):
        dtrain.Config(activation_checkpointing="some")
    engine = dtrain.init(strategy="single", activation_checkpointing="full")
    with pytest.raises(ConfigError, match="none was found in Linear; .* --blocks"):
        engine.setup(nn.Linear(4, 4))
    engine.close()
    with pytest.raises(ConfigError, match=r"blocks\.0\.1 twice; .* --blocks"):
        apply_activation_checkpointing(Norms(), "full")
    with pytest.raises(ConfigError, match="has one block; use full"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(4, 4)), "selective")
    hooked = dropout_gpt()
    hooked.blocks[2].forward = lambda x: x
    with pytest.raises(ConfigError, match="Block blocks.2 has a forward set on the instance"):
        apply_activation_checkpointing(hooked, "full")
