"""--precision fp16-mixed: fp16 compute, fp32 master weights, dynamic loss scaling.

Every strategy trains as `single` does in fp16-mixed; a step whose gradients overflow on
one rank only (its shard, its tensor-parallel part, its pipeline stage) is skipped on
every rank, counted, and the loss scale halved; the scale goes into checkpoints and comes
back on resume; what cannot honour it is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from training import finish

import dtrain
from dtrain.errors import ConfigError
from dtrain.observe.flops import peak_flops

STEPS = 4
POISONED = 2
"""The step whose gradients overflow (on one rank) in the runs that poison one."""
INITIAL_SCALE = 2.0**16
"""torch.amp.GradScaler's first loss scale; a skipped step halves it."""

FP16_CLOSE = {"rtol": 1e-3, "atol": 1e-3}
"""fp16-mixed under another strategy against `single` in fp16-mixed: an fp16 product
rounds to about 5e-4 of itself, and FSDP2's policy runs whole layers in fp16 where
autocast runs only the matmuls, pipeline micro-batches and tensor-parallel halves round
their partial results apart (5e-5 apart after these steps); a step taken on one rank but
skipped on another, or a skipped step taken, moves a parameter by lr x gradient (7e-2
here)."""


class Net(nn.Sequential):
    """Linear-tanh-linear: a chain a pipeline cuts in two, with a tensor-parallel plan."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        return {"0": "colwise", "2": "rowwise"}


def samples() -> TensorDataset:
    """64 samples of 8 features and 4 classes, the same whatever torch's seed."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 4, (64,), generator=generator))


def _poison(model: nn.Module) -> None:
    """Make one element of this rank's part of the first weight's gradient infinite."""
    grad = next(p for p in model.parameters() if p.grad is not None).grad
    assert grad is not None
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    local.view(-1)[0] = math.inf


ARMED = {"on": False}
"""Under a pipeline, the gradient hook on the first layer's weight (on the first stage's
rank only) returns infinities while this is on."""


def _infinite_when_armed(grad: torch.Tensor) -> torch.Tensor:
    return torch.full_like(grad, math.inf) if ARMED["on"] else grad


def run(
    strategy: str,
    poison_rank: int | None = None,
    close: bool = True,
    metrics: str | None = None,
    checkpoint: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """`STEPS` steps of SGD on `Net` in fp16-mixed under `strategy`; with `poison_rank`,
    step `POISONED` overflows on that rank only. Returns the parameters (main rank), the
    parameters before and after the poisoned step, the skipped count and the scale."""
    engine = dtrain.init(
        strategy=strategy, seed=0, precision="fp16-mixed", metrics_json=metrics, **options
    )
    model = Net()
    pipelined = strategy == "pipeline"
    if pipelined and poison_rank is not None:
        model[0].weight.register_hook(_infinite_when_armed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(samples(), global_batch_size=8)
    around: list[Any] = []
    for batch in engine.progress(loader):
        poisoned = poison_rank is not None and engine.step + 1 == POISONED
        if poisoned:
            around.append(engine.state_dict())
        if poisoned and pipelined:
            ARMED["on"] = True
            engine.train_step(batch, F.cross_entropy)
            ARMED["on"] = False
        elif poisoned:
            inputs, targets = engine.to_device(batch)
            with engine.autocast():
                loss = F.cross_entropy(model(inputs), targets)
            engine.backward(loss)
            if engine.rank == poison_rank:
                _poison(engine.strategy.unwrap())
            engine.clip_grad_norm_(1e9)  # unscales first; a bound that never clips
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.train_step(batch, F.cross_entropy)
        if poisoned:
            around.append(engine.state_dict())
        if engine.step == STEPS:
            break
    if checkpoint is not None:
        engine.save(checkpoint)
    scaling = engine.loss_scaling
    assert scaling is not None
    result = {
        "skipped": scaling.skipped,
        "scale": scaling.scale_value,
        "state": scaling.state_dict(),
        "around": around,
    }
    del model, optimizer
    result["params"] = finish(engine, close)
    return result


def two_process_runs() -> list[dict[str, Any]]:
    """In these two processes: step `POISONED` overflowing on rank 1 under ddp (after the
    all-reduce), zero3 and tensor (in its part of the gradient), and on rank 0 under a
    pipeline (the first stage only)."""
    runs = [
        ("ddp", 1, {}),
        ("zero3", 1, {}),
        ("tensor", 1, {"tp": 2}),
        ("pipeline", 0, {"pp": 2}),
    ]
    return [
        run(strategy, rank, close=i == len(runs) - 1, **options)
        for i, (strategy, rank, options) in enumerate(runs)
    ]


def test_a_step_that_overflows_is_skipped_counted_and_resumed(tmp_path: Path) -> None:
    """Under single: the poisoned step leaves the parameters as they were, halves the
    scale and is counted (metrics JSON, summary); towers train as single does; a
    checkpoint in either format brings the scale and its growth tracker back."""
    metrics = tmp_path / "metrics.json"
    saved = tmp_path / "ckpt"
    poisoned = run("single", 0, metrics=str(metrics), checkpoint=str(saved))
    before, after = poisoned["around"]
    assert_close(after, before, rtol=0, atol=0)
    assert poisoned["skipped"] == 1 and poisoned["scale"] == INITIAL_SCALE / 2
    assert poisoned["state"]["_growth_tracker"] == STEPS - POISONED
    result = json.loads(metrics.read_text())
    assert result["steps"] == STEPS
    assert result["skipped_steps"] == 1 and result["loss_scale"] == INITIAL_SCALE / 2

    clean = run("single")
    assert clean["skipped"] == 0 and clean["scale"] == INITIAL_SCALE
    assert_close(run("towers", towers=2)["params"], clean["params"], **FP16_CLOSE)

    sharded = tmp_path / "sharded"
    run("single", 0, checkpoint=str(sharded), checkpoint_format="sharded")
    for path in (saved, sharded):
        engine = dtrain.init(strategy="single", precision="fp16-mixed")
        model = Net()
        engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
        assert engine.loss_scaling is not None
        assert engine.loss_scaling.scale_value == INITIAL_SCALE
        engine.load(path)
        assert engine.loss_scaling.state_dict() == poisoned["state"], path
        engine.close()


@pytest.mark.timeout(180)
def test_two_processes_train_as_single_and_skip_together() -> None:
    """ddp, zero3, tensor and pipeline in fp16-mixed equal `single` in fp16-mixed, the
    overflow of one rank's gradients skipping the step on both ranks (each counts one
    skip and holds the same halved scale)."""
    results = run_ranks(two_process_runs, 2, timeout=170)
    reference = run("single", 0)["params"]
    names = ["ddp", "zero3", "tensor", "pipeline"]
    for name, by_rank in zip(names, zip(*results, strict=True), strict=True):
        for rank, got in enumerate(by_rank):
            assert (got["skipped"], got["scale"]) == (1, INITIAL_SCALE / 2), (name, rank)
        params = by_rank[0]["params"]
        assert_close(params, reference, **FP16_CLOSE, msg=lambda m, n=name: f"{n}: {m}")


def test_what_cannot_scale_the_loss_is_refused_by_name() -> None:
    """Parameter servers apply the update themselves, and a closure re-evaluates an
    unscaled loss: both refused with what to do."""
    with pytest.raises(ConfigError, match="not supported under --strategy ps"):
        dtrain.init(strategy="ps", precision="fp16-mixed")
    engine = dtrain.init(strategy="single", precision="fp16-mixed")
    model = Net()
    with pytest.raises(ConfigError, match="LBFGS.step re-evaluates the loss in a closure"):
        engine.setup(model, torch.optim.LBFGS(model.parameters()))
    engine.close()


def test_fp16_peaks_are_known_where_fp16_tensor_cores_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16-mixed counts fp16 tensor cores' peak (bf16's rate where both exist); a V100 has
    no bf16 peak to report."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2")
    assert peak_flops(cuda, "fp16-mixed") == 125.0e12
    assert peak_flops(cuda, "bf16-mixed") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB")
    assert peak_flops(cuda, "fp16-mixed") == peak_flops(cuda, "bf16-mixed") == 989.4e12
