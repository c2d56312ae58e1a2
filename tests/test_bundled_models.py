"""The bundled digits models (mlp, cnn) under the model-parallel strategies: pipeline and
tensor train them exactly as one process does, and layouts they cannot take are refused
with what to use instead. (The GPT's checks are in test_model_parallel.py, the data-parallel
strategies' on the digits MLP in test_equivalence.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from distributed import run_ranks
from torch.testing import assert_close
from training import train

from dtrain.errors import ConfigError
from dtrain.models import build
from dtrain.models.digits import DigitsCNN, DigitsMLP
from dtrain.parallel.split import Stage, layers_of, split_layers
from dtrain.parallel.tensor_plan import plan_of

STEPS = 5
MODELS = ("mlp", "cnn")
PARALLEL = [
    {"strategy": "pipeline", "microbatches": 4},  # 1F1B, the default schedule
    {"strategy": "pipeline", "schedule": "interleaved", "microbatches": 4},
    {"strategy": "tensor"},
]


def train_digits(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, torch.Tensor]]:
    """`training.train` of each (bundled model, options), one after the other in this
    process group."""
    last = len(runs) - 1
    return [
        train(close=i == last, steps=STEPS, model_name=f"bundled:{model}", **options)
        for i, (model, options) in enumerate(runs)
    ]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    """Single-process parameters of each bundled digits model after 5 SGD steps."""
    return {model: train_digits([(model, {"strategy": "single"})])[0] for model in MODELS}


@pytest.mark.timeout(150)
def test_pipeline_and_tensor_at_two_ranks_match_single(reference: dict) -> None:
    runs = [(model, options) for model in MODELS for options in PARALLEL]
    results = run_ranks(train_digits, 2, runs, timeout=140)[0]
    for (model, options), params in zip(runs, results, strict=True):
        label = f"{model}, " + ", ".join(f"{k}={v}" for k, v in options.items())
        assert_close(params, reference[model], msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("model", MODELS)
def test_stages_keep_canonical_names_and_compose_to_the_model(model: str) -> None:
    net = build(model)
    images = torch.rand(3, 1, 8, 8)
    for stages in (2, 3):
        parts = [Stage(group) for group in split_layers(layers_of(net), stages, None)]
        assert all(list(part.parameters()) for part in parts)  # no idle stage
        assert [n for part in parts for n in part.state_dict()] == list(net.state_dict())
        x = images
        for part in parts:
            x = part(x)
        assert_close(x, net(images))


def test_tensor_plans_split_the_hidden_layers_and_name_a_size_that_does_not_divide() -> None:
    assert set(plan_of(DigitsMLP(), 4)) == {"net.1", "net.3"}
    assert set(plan_of(DigitsCNN(), 8)) == {"head.1", "head.3"}
    with pytest.raises(ConfigError) as odd:
        plan_of(DigitsMLP(), 3)
    assert str(odd.value).startswith(
        "net.1 has 128 output features, which --tp 3 cannot split evenly in DigitsMLP's "
        "tensor-parallel plan; pick a --tp that divides 128 (such as 2 or 4 or 8)"
    )
    with pytest.raises(ConfigError, match="head.1 has 128 output features, which --tp 5"):
        plan_of(DigitsCNN(), 5)


def test_more_stages_than_layers_are_refused_with_the_layers_named() -> None:
    with pytest.raises(ConfigError) as many:
        split_layers(layers_of(DigitsMLP()), 7, None)
    assert str(many.value).startswith(
        "7 pipeline stages need at least 7 layers, but the model has 6 (net.0, net.1, net.2, "
        "net.3, net.4, net.5); use fewer stages"
    )


@pytest.mark.timeout(120)
def test_demo_trains_the_mlp_under_pipeline(tmp_path: Path) -> None:
    metrics = tmp_path / "m.json"
    proc = run_cli(
        "demo", "--model", "mlp", "--strategy", "pipeline", "--nproc", "2", "--steps", "2",
        "--out", str(tmp_path), "--metrics-json", str(metrics), cwd=tmp_path, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(metrics.read_text())
    assert result["steps"] == 2 and result["stages"] == "net.0+net.1+net.2 / net.3+net.4+net.5"
