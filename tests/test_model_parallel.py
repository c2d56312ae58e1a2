"""pipeline, tensor and hybrid train the bundled GPT exactly as one process does, and their
checkpoints move to and from single."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import run_cli
from distributed import run_ranks
from torch.testing import assert_close
from training import train, train_variants

import dtrain
from dtrain.models.gpt import GPT, SIZES, lm_loss

STEPS = 5
GPT_RUN = {"model_name": "gpt", "steps": STEPS}


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process parameters of the tiny GPT after 5 AdamW steps."""
    return train(strategy="single", **GPT_RUN)


def check_all(results: list[dict], variants: list[dict], expected: dict) -> None:
    for variant, params in zip(variants, results, strict=True):
        label = ", ".join(f"{k}={v}" for k, v in variant.items() if k not in GPT_RUN)
        assert_close(params, expected, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.timeout(240)
def test_two_ranks_pipeline_schedules_and_tensor_match_single(reference: dict) -> None:
    variants = [
        {"strategy": "pipeline", "schedule": schedule, "microbatches": 4, **GPT_RUN}
        for schedule in ("gpipe", "1f1b", "interleaved")
    ]
    variants.append({"strategy": "pipeline", "schedule": "gpipe", "microbatches": 1, **GPT_RUN})
    variants.append({"strategy": "tensor", **GPT_RUN})
    check_all(run_ranks(train_variants, 2, variants, timeout=220)[0], variants, reference)


def first_losses(strategy: str) -> list[float]:
    """The losses train_step reports for the first 3 steps of the tiny GPT."""
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
    engine.close()
    return losses


@pytest.mark.timeout(120)
def test_the_pipeline_reports_the_losses_single_computes() -> None:
    """torch calls the loss function once more at the first step, on uninitialised
    outputs, while it learns the shapes: that call must not reach the reported loss."""
    pipelined = run_ranks(first_losses, 2, "pipeline", timeout=100)
    expected = first_losses("single")
    for losses in pipelined:
        assert_close(losses, expected, rtol=1e-5, atol=1e-6)


def non_finite_and_reshaped_batches() -> list[str]:
    """Under a 2-stage pipeline: a NaN loss stops every rank with the gradients cleared,
    and a batch of another shape than the first is refused. Returns the messages."""
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
    engine.close()
    return messages


@pytest.mark.timeout(120)
def test_pipeline_stops_on_a_non_finite_loss_and_a_reshaped_batch() -> None:
    for messages in run_ranks(non_finite_and_reshaped_batches, 2):
        assert "nan" in messages[0]
        assert "fixed at its first step by a batch of shape [4, 8]; got [2, 8]" in messages[1]


def uneven_evaluation() -> float:
    """zero3 at world 2 evaluating 5 samples, 2 per rank and batch: rank 1 has no share of
    the last batch, yet rank 0's sharded forward needs it."""
    engine = dtrain.init(strategy="zero3")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    engine.setup(model, None)
    data = torch.utils.data.TensorDataset(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    loader = engine.dataloader(data, batch_size=2, shuffle=False, drop_last=False)
    result = engine.evaluate(loader, torch.nn.functional.cross_entropy)
    engine.close()
    return result["samples"]


@pytest.mark.timeout(120)
def test_sharded_evaluation_with_a_short_last_batch_does_not_hang() -> None:
    assert run_ranks(uneven_evaluation, 2, timeout=100) == [5, 5]


@pytest.mark.timeout(240)
def test_three_stages_match_single(reference: dict) -> None:
    variants = [
        {"strategy": "pipeline", "schedule": schedule, "microbatches": 4, **GPT_RUN}
        for schedule in ("gpipe", "1f1b")
    ]
    check_all(run_ranks(train_variants, 3, variants, timeout=220)[0], variants, reference)


@pytest.mark.timeout(300)
def test_hybrid_meshes_at_world_four_match_single(reference: dict) -> None:
    # 12 samples per step: 6 per replica at dp 2, cut into 3 micro-batches.
    variants = [
        {"strategy": "hybrid", "pp": 2, "microbatches": 3, **GPT_RUN},
        {"strategy": "hybrid", "tp": 2, **GPT_RUN},
        {"strategy": "hybrid", "pp": 2, "tp": 2, "schedule": "gpipe", "microbatches": 4, **GPT_RUN},
        {"strategy": "hybrid", "pp": 2, "microbatches": 3, "dp_mode": "zero3", **GPT_RUN},
        {"strategy": "hybrid", "tp": 2, "dp_mode": "zero2", **GPT_RUN},
    ]
    check_all(run_ranks(train_variants, 4, variants, timeout=280)[0], variants, reference)


@pytest.mark.timeout(300)
def test_checkpoints_move_between_single_and_pipeline_x_tensor(tmp_path: Path) -> None:
    start, middle = str(tmp_path / "single-5"), str(tmp_path / "hybrid-10")
    train(strategy="single", checkpoint_out=start, **GPT_RUN)
    expected = train(strategy="single", checkpoint_in=start, model_name="gpt", steps=2 * STEPS)
    # pp2 x tp2 resumes single's model and AdamW state, then writes canonical names...
    hybrid = {"strategy": "hybrid", "pp": 2, "tp": 2, "checkpoint_in": start}
    run_ranks(train_variants, 4, [{**hybrid, "checkpoint_out": middle, **GPT_RUN}], timeout=280)
    plain = GPT(SIZES["tiny"])
    plain.load_state_dict(safetensors.torch.load_file(Path(middle) / "model.safetensors"))
    # ...which single resumes in turn, landing where an uninterrupted single run does.
    resumed = train(strategy="single", checkpoint_in=middle, **GPT_RUN)
    assert_close(resumed, expected)


@pytest.mark.timeout(300)  # starts processes: not in the quick loop
def test_demo_trains_the_gpt_under_hybrid(tmp_path: Path) -> None:
    flags = ("--strategy", "hybrid", "--nproc", "4", "--pp", "2", "--tp", "2")
    metrics = tmp_path / "m.json"
    proc = run_cli(
        "demo", "--model", "gpt", "--epochs", "2", *flags, "--out", str(tmp_path),
        "--metrics-json", str(metrics), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "hybrid" and result["world_size"] == 4
    assert result["layout"] == "dp1 x pp2 x tp2"
    assert result["stages"] == "embed+blocks.0 / blocks.1+head"
    assert all(float(ms) > 0 for ms in result["stage_compute_ms"].split(" / "))
    assert result["test_perplexity"] < 40
