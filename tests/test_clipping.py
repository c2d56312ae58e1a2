"""Gradient clipping by the global norm clips exactly as one process does, under every
strategy (and hsdp trains as one process does, with and without clipping): with a bound
that clips every step, the parameters after a few steps equal those of `single`, which
equal a plain loop with torch's own ``clip_grad_norm_``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from torch.testing import assert_close
from training import train, train_variants

import dtrain
from dtrain.config import Config
from dtrain.engine import Engine
from dtrain.errors import ConfigError
from dtrain.process.topology import Topology
from dtrain.strategies.specs import lookup

BOUND = 0.05  # the tiny GPT's gradient norm is well above this at every step
RUN = {"model_name": "gpt", "steps": 3, "optimizer_name": "sgd"}
# Its gradients fill two DDP buckets (DDP's first holds 1 MiB), which once deadlocked
# --hierarchical.
SMALL = {"model_name": "gpt:small", "steps": 2, "optimizer_name": "sgd"}
WORLD_2 = ("ddp", "zero1", "zero2", "zero3", "pipeline", "tensor")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    """`single` with clipping (checked against torch's clip_grad_norm_) and without."""
    clipped = train(strategy="single", clip_grad_norm=BOUND, **RUN)
    by_torch = train(strategy="single", manual=True, torch_clip=BOUND, **RUN)
    assert_close(clipped, by_torch)
    unclipped = train(strategy="single", **RUN)
    assert any(not torch.allclose(clipped[k], unclipped[k]) for k in clipped), "never clipped"
    return {"clipped": clipped, "unclipped": unclipped, "small": train(strategy="single", **SMALL)}


@pytest.fixture(scope="module")
def reference(references: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return references["clipped"]


@pytest.mark.timeout(120)
def test_towers_clip_as_single(reference: dict[str, torch.Tensor]) -> None:
    assert_close(train(strategy="towers", towers=2, clip_grad_norm=BOUND, **RUN), reference)


@pytest.mark.timeout(300)
def test_two_process_strategies_clip_as_single(reference: dict[str, torch.Tensor]) -> None:
    variants = [{"strategy": s, "clip_grad_norm": BOUND, **RUN} for s in WORLD_2]
    results = run_ranks(train_variants, 2, variants, timeout=280)[0]
    for variant, params in zip(variants, results, strict=True):
        label = variant["strategy"]
        assert_close(params, reference, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.timeout(300)
def test_four_process_layouts_clip_as_single(
    references: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Pipeline x tensor stages, data-parallel replicas of tensor shards, and hsdp (two
    replicas of a model sharded over two ranks), which also trains as single unclipped,
    as does ddp averaging inside two machines of two ranks first (--hierarchical), on a
    model of one DDP bucket and on one of two."""
    variants = [
        {"strategy": "ddp", "hierarchical": True, "nproc": 2, **RUN},  # 2 machines x 2
        {"strategy": "ddp", "hierarchical": True, "nproc": 2, **SMALL},
        {"strategy": "hsdp", "shard_size": 2, **RUN},
        {"strategy": "hsdp", "shard_size": 2, "clip_grad_norm": BOUND, **RUN},
        {"strategy": "hybrid", "pp": 2, "tp": 2, "clip_grad_norm": BOUND, **RUN},
        {
            "strategy": "hybrid",
            "dp": 2,
            "tp": 2,
            "dp_mode": "zero3",
            "clip_grad_norm": BOUND,
            **RUN,
        },
    ]
    results = run_ranks(train_variants, 4, variants, timeout=280)[0]
    for variant, params in zip(variants, results, strict=True):
        expected = references["clipped" if "clip_grad_norm" in variant else "unclipped"]
        if variant["model_name"] == "gpt:small":
            expected = references["small"]
        assert_close(params, expected, msg=lambda m, v=variant: f"{v}: {m}")


def test_a_bound_that_is_not_positive_is_refused() -> None:
    for bound in (0.0, -1.0):
        with pytest.raises(ConfigError, match="--clip-grad-norm must be positive"):
            dtrain.Config(clip_grad_norm=bound)


def test_hsdp_shard_groups_must_divide_the_processes() -> None:
    from dtrain.strategies.specs import lookup

    hsdp = lookup("hsdp")
    assert hsdp.layout(dtrain.Config(strategy="hsdp", nproc=2, nnodes=2, master="h:1"), 4).dp == 4
    for size in (1, 3):
        with pytest.raises(ConfigError, match="at least 2 and divide the 4 processes"):
            hsdp.layout(dtrain.Config(strategy="hsdp", shard_size=size), 4)
    with pytest.raises(ConfigError, match="--shard-size sets the shard groups"):
        dtrain.Config(strategy="zero3", shard_size=2)
    with pytest.raises(ConfigError, match="--hierarchical arranges ddp's gradient all-reduce"):
        dtrain.Config(strategy="zero3", hierarchical=True)


def test_what_clip_grad_norm_returns_under_sync_ps_is_what_the_docs_say() -> None:
    """Under sync ps the servers clip the round's mean gradient, which no worker holds, so
    a worker's `clip_grad_norm_` returns NaN, not a norm that differs from single's; every
    text that states what it returns says so."""
    worker = Topology(0, 2, 0, 2, torch.device("cpu"), "gloo")  # worker 0, then one server
    ps = lookup("ps").build(Config(strategy="ps", servers=1), worker)
    assert torch.isnan(ps.clip_grad_norm_(BOUND))
    root = Path(__file__).resolve().parent.parent
    texts = {
        "README.md": (root / "README.md").read_text(),
        "docs/strategies.md": (root / "docs" / "strategies.md").read_text(),
        "Engine.clip_grad_norm_": Engine.clip_grad_norm_.__doc__ or "",
    }
    for name, text in texts.items():
        assert "NaN under sync ps, where the servers clip" in " ".join(text.split()), name
