"""`--strategy local-sgd`: replicas that train alone for H optimizer steps, then sync by
averaging their parameters, or by DiLoCo's outer optimizer.

A spawned job of two ranks runs every training variant (a float64 model with BatchNorm
and SGD with nesterov momentum and weight decay, fed by step index, so that the test can
recompute by hand what each replica trains); the tests compare its results: H = 1 with
ddp, H = 4 with a hand computation, DiLoCo's identity with plain averaging, resume
exactness, and a checkpoint's model and its load under ddp; one of three ranks checks H = 1
against ddp where the mean divides by 3, and a load at another number of processes.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.testing import assert_close

import dtrain
from dtrain.checkpoint import rank_states
from dtrain.checkpoint.format import TRAINER_FILE
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.strategies.specs import lookup

GLOBAL_BATCH = 12  # divides over 2 and 3 replicas, and 2 replicas' shares into 2 micro-batches


def _model(batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(8)] if batchnorm else []
    return nn.Sequential(nn.Linear(5, 8), *norm, nn.Tanh(), nn.Linear(8, 3)).double()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2
    )


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's share of the global batch of optimizer step `step` (from 0)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    share = GLOBAL_BATCH // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _run(
    steps: int,
    options: dict[str, Any],
    batchnorm: bool = True,
    load: str | None = None,
    save_at: dict[int, str] | None = None,
    close: bool = False,
) -> dict[str, Any]:
    """Train under `options` until optimizer step `steps`; return this rank's replica,
    the canonical model (main rank), the strategy's figures and the replica at each save."""
    engine = dtrain.init(seed=0, **options)
    model = _model(batchnorm)
    model, optimizer = engine.setup(model, _optimizer(model))
    if load:
        engine.load(load)
    at_save = {}
    while engine.step < steps:
        engine.train_step(_batch(engine.step, engine.rank, engine.world_size), F.cross_entropy)
        if engine.step in (save_at or {}):
            engine.save(save_at[engine.step])  # type: ignore[index]
            at_save[engine.step] = _state(engine.module)
    result = {
        "replica": _state(engine.module),
        "canonical": engine.state_dict(),
        "figures": engine.strategy.figures(),
        "at_save": at_save,
    }
    del model, optimizer
    gc.collect()
    if close:
        engine.close()
    else:
        engine.strategy.close()  # keep the process group for the next variant
    return result


def _variants(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    last = list(variants)[-1]
    return {name: _run(**kw, close=name == last) for name, kw in variants.items()}


def _without_optimizer() -> str:
    """The error of a step of a loop by hand whose optimizer `engine.setup` never saw."""
    engine = dtrain.init(seed=0, strategy="local-sgd", sync_every=2)
    model, _ = engine.setup(_model())
    optimizer = _optimizer(model)
    x, y = _batch(0, engine.rank, engine.world_size)
    try:
        engine.backward(F.cross_entropy(model(x), y))
        optimizer.step()
    except ConfigError as e:
        return str(e)
    finally:
        engine.strategy.close()
    return "trained"


def _job(root: str) -> dict[str, dict[str, Any]]:
    local = {"strategy": "local-sgd"}
    diloco = {**local, "sync_every": 3, "outer_optimizer": "nesterov"}
    a, b, c, d, e = (f"{root}/{name}" for name in "abcde")
    sharded = {**diloco, "checkpoint_format": "sharded"}
    refused = _without_optimizer()
    return {"no_optimizer": {"error": refused}} | _variants(
        {
            "plain_whole": {"steps": 7, "options": {**local, "sync_every": 3}, "save_at": {4: d}},
            "plain_from_4": {"steps": 7, "options": {**local, "sync_every": 3}, "load": d},
            "h8_to_5": {"steps": 5, "options": {**local, "sync_every": 8}, "save_at": {5: e}},
            "h4_from_5": {"steps": 7, "options": {**local, "sync_every": 4}, "load": e},
            "ddp_momentum": {"steps": 5, "options": {"strategy": "ddp"}},
            "h1_momentum": {"steps": 5, "options": {**local, "sync_every": 1}},
            "h4_at3": {"steps": 3, "options": {**local, "sync_every": 4}},
            "h4_at4": {"steps": 4, "options": {**local, "sync_every": 4}},
            "h2_ga2": {
                "steps": 4,
                "options": {**local, "sync_every": 2, "grad_accumulation": 2},
                "batchnorm": False,
            },
            "h2_ga1": {"steps": 4, "options": {**local, "sync_every": 2}, "batchnorm": False},
            "plain_h3": {"steps": 7, "options": {**local, "sync_every": 3}},
            "outer_sgd_h3": {
                "steps": 7,
                "options": {**local, "sync_every": 3, "outer_optimizer": "sgd"},
            },
            "unsaved": {"steps": 8, "options": diloco},
            "whole": {"steps": 8, "options": diloco, "save_at": {4: a, 6: b}},
            "from_4": {"steps": 8, "options": diloco, "load": a},
            "from_6": {"steps": 8, "options": diloco, "load": b},
            "sharded_to_4": {"steps": 4, "options": sharded, "save_at": {4: c}},
            "sharded_from_4": {"steps": 8, "options": sharded, "load": c},
            "ddp_loads_4": {"steps": 4, "options": {"strategy": "ddp"}, "load": a},
        }
    )


def _job3(root: str) -> dict[str, dict[str, Any]]:
    return _variants(
        {
            "ddp_momentum": {"steps": 5, "options": {"strategy": "ddp"}},
            "h1_momentum": {"steps": 5, "options": {"strategy": "local-sgd", "sync_every": 1}},
            "loads_world2": {
                "steps": 4,
                "options": {"strategy": "local-sgd", "sync_every": 3, "outer_optimizer": "sgd"},
                "load": f"{root}/a",
            },
        }
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("local_sgd"))
    two = run_ranks(_job, 2, root, timeout=150)
    return {"root": root, "two": two, "three": run_ranks(_job3, 3, root, timeout=90)}


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained tensors: under ddp rank 0's BatchNorm statistics reach every replica
    (DDP broadcasts buffers), under local-sgd their mean does."""
    return {k: v for k, v in state.items() if "running" not in k and "batches" not in k}


def _alone(rank: int, world: int, steps: int) -> dict[str, torch.Tensor]:
    """What replica `rank` holds after `steps` steps on its own shares, by plain torch."""
    model = _model()
    optimizer = _optimizer(model)
    for step in range(steps):
        x, y = _batch(step, rank, world)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _state(model)


@pytest.mark.timeout(300)
def test_h1_averaging_equals_ddp_under_sgd_with_momentum(runs: dict) -> None:
    # Nesterov momentum and weight decay: updates linear in the gradient, so the mean of
    # the replicas' momentum buffers is ddp's buffer, and their mean update is ddp's.
    for ranks in (runs["two"], runs["three"]):
        main = ranks[0]
        assert_close(
            _params(main["h1_momentum"]["canonical"]), _params(main["ddp_momentum"]["canonical"])
        )
        assert main["h1_momentum"]["figures"]["syncs"] == 5


@pytest.mark.timeout(300)
def test_h4_replicas_train_alone_then_hold_the_mean_of_what_each_trained(runs: dict) -> None:
    two = runs["two"]
    for rank in (0, 1):
        assert_close(two[rank]["h4_at3"]["replica"], _alone(rank, 2, 3))
    assert not torch.equal(
        two[0]["h4_at3"]["replica"]["0.weight"], two[1]["h4_at3"]["replica"]["0.weight"]
    )
    alone = [_alone(rank, 2, 4) for rank in (0, 1)]
    mean = {
        k: (alone[0][k] + alone[1][k]) / 2 if v.is_floating_point() else v
        for k, v in alone[0].items()
    }
    for rank in (0, 1):
        assert_close(two[rank]["h4_at4"]["replica"], mean)  # BatchNorm statistics too
    assert two[0]["h4_at4"]["figures"]["syncs"] == 1


@pytest.mark.timeout(300)
def test_syncs_count_optimizer_steps_not_micro_batches(runs: dict) -> None:
    main = runs["two"][0]
    assert main["h2_ga2"]["figures"]["syncs"] == 2
    assert_close(main["h2_ga2"]["replica"], main["h2_ga1"]["replica"])


@pytest.mark.timeout(300)
def test_outer_sgd_at_lr_1_without_momentum_is_plain_averaging(runs: dict) -> None:
    # global - 1.0 * mean(global - replica) = mean(replica): the same after the syncs at
    # steps 3 and 6 and the local step 7 after them.
    for rank in runs["two"]:
        assert_close(rank["outer_sgd_h3"]["replica"], rank["plain_h3"]["replica"])
    report = runs["two"][0]["outer_sgd_h3"]["figures"]
    assert (report["outer_lr"], report["outer_momentum"], report["syncs"]) == (1.0, 0.0, 2)


@pytest.mark.timeout(300)
def test_diloco_resume_between_and_at_syncs_equals_uninterrupted(runs: dict) -> None:
    for rank in runs["two"]:
        whole = rank["whole"]["replica"]
        # the replicas differ at step 8 (two steps after the sync): each is compared; a
        # save changes nothing (no sync of its own)
        for resumed in ("unsaved", "from_4", "from_6", "sharded_from_4"):
            assert_close(rank[resumed]["replica"], whole, rtol=0, atol=0)
    # The sharded checkpoint's replicas are entries each rank wrote, never gathered.
    trainer = torch.load(Path(runs["root"]) / "c" / TRAINER_FILE, weights_only=True)
    assert rank_states.LISTED not in trainer and trainer[rank_states.WRITTEN] == 2
    assert not torch.equal(
        runs["two"][0]["whole"]["replica"]["0.weight"],
        runs["two"][1]["whole"]["replica"]["0.weight"],
    )


@pytest.mark.timeout(300)
def test_plain_averaging_resumes_exactly_and_a_smaller_h_syncs_at_once(runs: dict) -> None:
    for rank in runs["two"]:
        resumed, whole = rank["plain_from_4"]["replica"], rank["plain_whole"]["replica"]
        assert_close(resumed, whole, rtol=0, atol=0)
        # saved 5 steps after a sync under H = 8, resumed under H = 4: it syncs at step 6
        # (not never, as an equality test of the step count would) and not again by step 7
        assert rank["h4_from_5"]["figures"]["syncs"] == 1


@pytest.mark.timeout(300)
def test_training_without_the_optimizer_given_to_setup_is_refused(runs: dict) -> None:
    for rank in runs["two"]:
        error = rank["no_optimizer"]["error"]
        assert "pass the optimizer to engine.setup(model, optimizer)" in error


@pytest.mark.timeout(300)
def test_checkpoint_holds_the_mean_of_the_replicas_and_loads_under_ddp(runs: dict) -> None:
    two = runs["two"]
    at_4 = [two[rank]["whole"]["at_save"][4] for rank in (0, 1)]
    mean = {
        k: (at_4[0][k] + at_4[1][k]) / 2 if v.is_floating_point() else v for k, v in at_4[0].items()
    }
    saved = safetensors.torch.load_file(Path(runs["root"]) / "a" / "model.safetensors")
    assert_close(saved, mean)
    manifest = json.loads((Path(runs["root"]) / "a" / "manifest.json").read_text())
    assert (manifest["strategy"], manifest["world_size"], manifest["step"]) == ("local-sgd", 2, 4)
    for rank in (0, 1):
        assert_close(two[rank]["ddp_loads_4"]["replica"], saved, rtol=0, atol=0)
    # At another number of processes every replica starts from the saved model.
    for rank in runs["three"]:
        assert_close(rank["loads_world2"]["replica"], saved, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"strategy": "ddp", "sync_every": 4},
            "--sync-every: options of the syncs of --strategy local-sgd",
        ),
        (
            {"strategy": "zero3", "outer_optimizer": "nesterov", "outer_lr": 0.7},
            "drop --outer-optimizer, --outer-lr.",
        ),
        ({"strategy": "local-sgd", "sync_every": 0}, "--sync-every must be at least 1"),
        ({"strategy": "local-sgd", "outer_optimizer": "adam"}, "Unknown --outer-optimizer 'adam'"),
        ({"strategy": "local-sgd", "outer_lr": 0.7}, "add --outer-optimizer sgd or nesterov"),
        (
            {"strategy": "local-sgd", "outer_optimizer": "sgd", "outer_lr": float("nan")},
            "--outer-lr must be a positive",
        ),
        (
            {"strategy": "local-sgd", "outer_optimizer": "sgd", "outer_lr": 0.0},
            "--outer-lr must be a positive",
        ),
        (
            {"strategy": "local-sgd", "outer_optimizer": "sgd", "outer_momentum": 1.0},
            "--outer-momentum must lie in [0, 1)",
        ),
        (
            {"strategy": "local-sgd", "outer_optimizer": "nesterov", "outer_momentum": 0.0},
            "nesterov needs a momentum above 0",
        ),
    ],
)
def test_refused_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config(**options)


def test_sync_batchnorm_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="local-sgd's replicas do not exchange"):
        lookup("local-sgd").check_options(Config(strategy="local-sgd", sync_batchnorm=True))
