"""pipeline, tensor and hybrid train the bundled GPT exactly as one process does, and their
checkpoints move to and from single."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import run_cli
from distributed import run_ranks
from torch.testing import assert_close
from training import finish, train, train_variants

import dtrain
from dtrain.models.gpt import GPT, SIZES, lm_loss

STEPS = 3
GPT_RUN = {"model_name": "gpt", "steps": STEPS}


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process parameters of the tiny GPT after `STEPS` AdamW steps."""
    return train(strategy="single", **GPT_RUN)


def check_all(results: list[dict], variants: list[dict], expected: dict) -> None:
    for variant, params in zip(variants, results, strict=True):
        label = ", ".join(f"{k}={v}" for k, v in variant.items() if k not in GPT_RUN)
        assert_close(params, expected, msg=lambda m, label=label: f"{label}: {m}")


TWO_RANKS = [
    *(
        {"strategy": "pipeline", "schedule": schedule, "microbatches": 4, **GPT_RUN}
        for schedule in ("gpipe", "1f1b", "interleaved")
    ),
    {"strategy": "pipeline", "schedule": "gpipe", "microbatches": 1, **GPT_RUN},
    {"strategy": "tensor", **GPT_RUN},
]
"""The pipeline schedules and tensor parallelism at two ranks."""


def first_losses(strategy: str, close: bool = True) -> list[float]:
    """The losses train_step reports for the first 3 steps of the tiny GPT (`close=False`
    keeps the process group for another run)."""
    from dtrain.datasets import load_text

    engine = dtrain.init(seed=0, strategy=strategy)
    model = GPT(SIZES["tiny"])
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_set, _ = load_text(context=SIZES["tiny"].context)
    losses = []
    for batch in engine.dataloader(train_set, batch_size=16):
        losses.append(float(engine.train_step(batch, lm_loss)))
        if len(losses) == 3:
            break
    del model, optimizer
    finish(engine, close)
    return losses


def non_finite_and_reshaped_batches() -> list[str]:
    """Under a 2-stage pipeline: a NaN loss stops every rank with the gradients cleared,
    and a batch of another shape than the first is refused. Returns the messages; the
    process group stays for the next run."""
    engine = dtrain.init(strategy="pipeline", schedule="gpipe", microbatches=2, log_every=1)
    model = GPT(SIZES["tiny"])
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.randint(0, 256, (4, 9))
    batch = (tokens[:, :-1], tokens[:, 1:])
    messages = []
    with pytest.raises(dtrain.NonFiniteLossError) as nan:
        engine.train_step(batch, lambda out, y: lm_loss(out, y) * float("nan"))
    assert all(p.grad is None for p in engine.module.parameters())
    messages.append(str(nan.value))
    with pytest.raises(dtrain.SetupError) as shape:
        engine.train_step((batch[0][:2], batch[1][:2]), lm_loss)
    messages.append(str(shape.value))
    del model
    finish(engine, close=False)
    return messages


def uneven_evaluation() -> float:
    """zero3 at world 2 evaluating 5 samples, 2 per rank and batch: rank 1 has no share of
    the last batch, yet rank 0's sharded forward needs it. The process group stays for
    the next run."""
    engine = dtrain.init(strategy="zero3")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    engine.setup(model, None)
    data = torch.utils.data.TensorDataset(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    loader = engine.dataloader(data, batch_size=2, shuffle=False, drop_last=False)
    result = engine.evaluate(loader, torch.nn.functional.cross_entropy)
    del model
    finish(engine, close=False)
    return result["samples"]


def two_rank_runs() -> dict[str, Any]:
    """Every two-rank check of this file, one after the other in one job."""
    return {
        "uneven": uneven_evaluation(),
        "messages": non_finite_and_reshaped_batches(),
        "losses": first_losses("pipeline", close=False),
        "params": train_variants(TWO_RANKS),  # the last run closes the process group
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """`two_rank_runs()` by rank."""
    return run_ranks(two_rank_runs, 2, timeout=220)


@pytest.mark.timeout(240)
def test_two_ranks_pipeline_schedules_and_tensor_match_single(
    reference: dict, two_ranks: list[dict[str, Any]]
) -> None:
    check_all(two_ranks[0]["params"], TWO_RANKS, reference)


@pytest.mark.timeout(240)
def test_the_pipeline_reports_the_losses_single_computes(two_ranks: list[dict[str, Any]]) -> None:
    """torch calls the loss function once more at the first step, on uninitialised
    outputs, while it learns the shapes: that call must not reach the reported loss."""
    expected = first_losses("single")
    for result in two_ranks:
        assert_close(result["losses"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_pipeline_stops_on_a_non_finite_loss_and_a_reshaped_batch(
    two_ranks: list[dict[str, Any]],
) -> None:
    for messages in (result["messages"] for result in two_ranks):
        assert "nan" in messages[0]
        assert "fixed at its first step by a batch of shape [4, 8]; got [2, 8]" in messages[1]


@pytest.mark.timeout(240)
def test_sharded_evaluation_with_a_short_last_batch_does_not_hang(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert [result["uneven"] for result in two_ranks] == [5, 5]


@pytest.mark.timeout(240)
def test_three_stages_match_single(reference: dict) -> None:
    variants = [
        {"strategy": "pipeline", "schedule": schedule, "microbatches": 4, **GPT_RUN}
        for schedule in ("gpipe", "1f1b")
    ]
    check_all(run_ranks(train_variants, 3, variants, timeout=220)[0], variants, reference)


HYBRID = [
    # 12 samples per step: 6 per replica at dp 2, cut into 3 micro-batches.
    {"strategy": "hybrid", "pp": 2, "microbatches": 3, **GPT_RUN},
    {"strategy": "hybrid", "tp": 2, **GPT_RUN},
    {"strategy": "hybrid", "pp": 2, "tp": 2, "schedule": "gpipe", "microbatches": 4, **GPT_RUN},
    {"strategy": "hybrid", "pp": 2, "microbatches": 3, "dp_mode": "zero3", **GPT_RUN},
    {"strategy": "hybrid", "tp": 2, "dp_mode": "zero2", **GPT_RUN},
]
"""The hybrid meshes at four ranks."""


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, Path]:
    """One job of four ranks: the parameters of each of `HYBRID`, then pp2 x tp2 resuming
    single's checkpoint after `STEPS` steps (model and AdamW state) and saving `STEPS`
    steps later (canonical names). Returns the parameters and both checkpoints."""
    root = tmp_path_factory.mktemp("hybrid")
    start, middle = root / "single-start", root / "hybrid-middle"
    train(strategy="single", checkpoint_out=str(start), **GPT_RUN)
    resume = {"strategy": "hybrid", "pp": 2, "tp": 2, "checkpoint_in": str(start)}
    variants = [*HYBRID, {**resume, "checkpoint_out": str(middle), **GPT_RUN}]
    params = run_ranks(train_variants, 4, variants, timeout=280)[0]
    return params[: len(HYBRID)], start, middle


def hybrid_reads() -> dict[str, Any]:
    """pp2 x dp2 (hybrid, four ranks), --log-every 1: the loss a read shows after 3 steps of
    the tiny GPT and what each rank's third step returned (its replica's loss), then
    whether a NaN loss on replica 1 alone stopped this rank."""
    from dtrain.datasets import load_text

    engine = dtrain.init(seed=0, strategy="hybrid", pp=2, microbatches=2, log_every=1)
    model = GPT(SIZES["tiny"])
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_set, _ = load_text(context=SIZES["tiny"].context)
    batches = iter(engine.dataloader(train_set, batch_size=8))  # 16 a step, as single's
    for _ in range(3):
        returned = float(engine.train_step(next(batches), lm_loss))
    read = engine.check_loss()
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, returned)
    replica = engine.strategy.placement.dp_rank
    nan = float("nan") if replica == 1 else 1.0
    try:
        engine.train_step(next(batches), lambda out, y: lm_loss(out, y) * nan)
        stopped = False
    except dtrain.NonFiniteLossError:
        stopped = True
    del model, optimizer
    finish(engine, close=False)
    return {"read": read, "returned": everyone, "stopped": stopped}


@pytest.mark.timeout(200)
def test_a_pipeline_over_replicas_reads_the_global_loss_and_stops_together() -> None:
    """Each stage returns its replica's loss; the reads average the replicas (single's
    loss), and a NaN on one replica stops every rank of both."""
    expected = first_losses("single")[-1]
    results = run_ranks(hybrid_reads, 4, timeout=180)
    for result in results:
        assert result["read"] == pytest.approx(expected, rel=1e-5)
        assert sum(result["returned"]) / 4 == pytest.approx(expected, rel=1e-5)
        assert result["stopped"]


@pytest.mark.timeout(300)
def test_hybrid_meshes_at_world_four_match_single(
    reference: dict, four_ranks: tuple[list[dict], Path, Path]
) -> None:
    check_all(four_ranks[0], HYBRID, reference)


@pytest.mark.timeout(300)
def test_checkpoints_move_between_single_and_pipeline_x_tensor(
    four_ranks: tuple[list[dict], Path, Path],
) -> None:
    _, start, middle = four_ranks
    expected = train(strategy="single", checkpoint_in=str(start), model_name="gpt", steps=2 * STEPS)
    # pp2 x tp2 wrote canonical names, which a plain GPT loads...
    plain = GPT(SIZES["tiny"])
    plain.load_state_dict(safetensors.torch.load_file(middle / "model.safetensors"))
    # ...and single resumes in turn, landing where an uninterrupted single run does.
    resumed = train(strategy="single", checkpoint_in=str(middle), **GPT_RUN)
    assert_close(resumed, expected)


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_demo_trains_the_gpt_under_hybrid(tmp_path: Path) -> None:
    flags = ("--strategy", "hybrid", "--nproc", "4", "--pp", "2", "--tp", "2")
    metrics = tmp_path / "m.json"
    proc = run_cli(
        "demo", "--model", "gpt", "--steps", "6", *flags, "--out", str(tmp_path),
        "--metrics-json", str(metrics), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "hybrid" and result["world_size"] == 4
    assert result["layout"] == "dp1 x pp2 x tp2"
    assert result["stages"] == "embed+blocks.0 / blocks.1+head"
    assert all(float(ms) > 0 for ms in result["stage_compute_ms"].split(" / "))
    assert result["test_perplexity"] < 100  # it learns: an untrained model's is about 256
