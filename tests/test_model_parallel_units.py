"""Model-parallel building blocks alone: balanced splits, canonical names, and the errors
bad layouts get (all in one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, SIZES, GPTConfig
from dtrain.parallel.degrees import Degrees, check_schedule, degrees_for
from dtrain.parallel.split import Stage, layers_of, partition, split_layers
from dtrain.parallel.tensor_plan import plan_of
from dtrain.strategies.specs import lookup


def test_partition_minimises_the_largest_stage() -> None:
    assert partition([1, 1, 1, 1], 2) == [0, 2]
    assert partition([4, 1, 1, 1, 1], 2) == [0, 1]
    assert partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7]  # 15 / 13 / 17


def test_stages_keep_canonical_names_and_compose_to_the_model() -> None:
    model = GPT(SIZES["tiny"])
    groups = split_layers(layers_of(model), 3, None)
    # Parameters: embed 20 k, each block 50 k, head 16.5 k.
    assert [[name for name, _ in g] for g in groups] == [
        ["embed"],
        ["blocks.0"],
        ["blocks.1", "head"],
    ]
    stages = [Stage(g) for g in groups]
    names = [n for stage in stages for n in stage.state_dict()]
    assert names == list(model.state_dict())
    tokens = torch.randint(0, 256, (2, 8))
    x = tokens
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(tokens))


def test_split_points_and_their_errors() -> None:
    chain = layers_of(GPT(SIZES["tiny"]))
    groups = split_layers(chain, 2, ["blocks.1"])
    assert [name for name, _ in groups[1]] == ["blocks.1", "head"]
    with pytest.raises(ConfigError, match="name no layer; the layers are embed, blocks.0"):
        split_layers(chain, 2, ["block.1"])
    with pytest.raises(ConfigError, match="3 stages need 2 split point"):
        split_layers(chain, 3, ["blocks.1"])
    with pytest.raises(ConfigError, match="5 pipeline stages need at least 5 layers"):
        split_layers(chain, 5, None)


def test_a_model_that_is_not_a_chain_is_refused() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="pipeline_layers"):
        layers_of(Branchy())
    assert [n for n, _ in layers_of(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))] == ["0", "1"]


def test_tensor_plan_checks_heads_and_sizes() -> None:
    model = GPT(GPTConfig(dim=64, layers=1, heads=4))
    assert set(plan_of(model, 2)) == {
        f"blocks.*.{p}" for p in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.up", "mlp.down")
    }
    with pytest.raises(ConfigError, match="splits the 4 attention heads"):
        plan_of(model, 3)
    with pytest.raises(ConfigError, match="has none"):
        plan_of(nn.Sequential(nn.Linear(4, 4)), 2)

    class Odd(nn.Sequential):
        def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
            return {"0": "colwise"}

    with pytest.raises(ConfigError, match="0 has 5 output features, which --tp 2 cannot split"):
        plan_of(Odd(nn.Linear(4, 5)), 2)


def test_degrees_must_multiply_to_nproc() -> None:
    assert degrees_for("hybrid", 8, None, 2, 2) == Degrees(dp_replicate=2, pp=2, tp=2)
    assert degrees_for("pipeline", 3, None, None, None) == Degrees(pp=3)
    with pytest.raises(ConfigError, match="product of the degrees must equal --nproc"):
        degrees_for("hybrid", 4, 2, 2, 2)
    with pytest.raises(ConfigError, match="does not divide --nproc 3"):
        degrees_for("hybrid", 3, None, 2, None)
    with pytest.raises(ConfigError, match="use --strategy hybrid"):
        degrees_for("pipeline", 4, None, 2, 2)


def test_schedules_refuse_micro_batch_counts_they_cannot_run() -> None:
    with pytest.raises(ConfigError, match="--microbatches >= --pp 4"):
        check_schedule("1f1b", 2, 4)
    with pytest.raises(ConfigError, match="in 2 equal rounds"):
        check_schedule("interleaved", 5, 2)
    check_schedule("gpipe", 1, 4)  # the naive split
    with pytest.raises(ConfigError, match="raise --microbatches"):
        lookup("pipeline").layout(Config(strategy="pipeline", grad_accumulation=2), 2)
    with pytest.raises(ConfigError, match="has one stage .*; add --pp"):
        lookup("hybrid").layout(Config(strategy="hybrid", microbatches=4), 2)
    with pytest.raises(ConfigError, match="add --strategy hybrid with --pp"):
        lookup("tensor").layout(Config(strategy="tensor", schedule="gpipe"), 2)
    with pytest.raises(ConfigError, match="--dp-mode zero3 shards over data-parallel replicas"):
        lookup("pipeline").layout(Config(strategy="pipeline", dp_mode="zero3"), 2)


def test_the_demo_checks_batches_against_replicas_and_micro_batches() -> None:
    gpipe = Config(strategy="pipeline", nproc=3, schedule="gpipe", microbatches=4)
    assert lookup("pipeline").batch_layout(gpipe) == (1, 4)
    assert lookup("hybrid").batch_layout(Config(strategy="hybrid", nproc=4, pp=2)) == (2, 4)
    assert lookup("tensor").batch_layout(Config(strategy="tensor", nproc=2)) == (1, 1)
    with pytest.raises(ConfigError, match="Unknown --schedule 'zb'"):
        Config(strategy="pipeline", schedule="zb")
    with pytest.raises(ConfigError, match="only --schedule interleaved runs"):
        Config(strategy="pipeline", virtual_stages=2)
    with pytest.raises(ConfigError, match="--pp, --schedule shape model parallelism"):
        Config(strategy="ddp", pp=2, schedule="gpipe")


def test_launcher_refuses_a_layout_before_starting(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    proc = run_cli(
        "run", "--strategy", "hybrid", "--nproc", "3", "--pp", "2", str(script), cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "does not divide --nproc 3" in proc.stderr
    assert "started" not in proc.stderr
