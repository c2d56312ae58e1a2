"""The step never waits for the device: the loss is read back every --log-every steps
(and before checkpoints), and a non-finite loss is still caught and named. And a reader
follows one step through at most six of dtrain's files (tests/step_files.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from step_files import MOST_FILES, step_files, too_many
from torch import nn
from training import finish

import dtrain
from dtrain.datasets import load_digits
from dtrain.models.digits import DigitsMLP

STEPS = 50


def count_reads(
    strategy: str, log_every: int = 10, clip_grad_norm: float | None = None, close: bool = True
) -> int:
    """Host reads of tensors (`.item()`, `.tolist()`) inside `engine.train_step` over a
    50-step loop (the loader's own reads of CPU index tensors, once per epoch, aside),
    clipping the gradient norm if asked (which must not read it back). `close=False` keeps
    the process group for another run."""
    engine = dtrain.init(
        strategy=strategy, seed=0, log_every=log_every, clip_grad_norm=clip_grad_norm
    )
    model = DigitsMLP(hidden=16)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    train_set, _ = load_digits()
    loader = engine.dataloader(train_set, batch_size=8)
    reads = 0
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist")}

    def counted(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any) -> Any:
            nonlocal reads
            reads += 1
            return originals[name](self, *args)

        return read

    for batch in engine.progress(loader):
        for name in originals:
            setattr(torch.Tensor, name, counted(name))
        try:
            engine.train_step(batch, F.cross_entropy)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        if engine.step == STEPS:
            break
    del model, optimizer
    finish(engine, close)
    return reads


def test_single_reads_the_loss_once_per_log_interval() -> None:
    assert count_reads("single") == STEPS // 10
    assert count_reads("single", log_every=25) == STEPS // 25
    assert count_reads("single", clip_grad_norm=0.5) == STEPS // 10  # the norm stays put


TWO_PROCESS_STEPS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "hsdp": {"shard_size": 2},
    "local-sgd": {},
    "tensor": {"gpt": True},
    "pipeline": {"gpt": True, "microbatches": 2},
}
"""The strategies whose `step_files` the two-process job measures, with their options."""


def ranks_losses() -> dict[str, Any]:
    """Under ddp with --log-every 4, each rank's loss scaled by its rank + 1: the loss a
    read returns against the ranks' own, then rank 1's loss infinite at step 5 and rank
    0's at step 6: (the read, the mean of the ranks' last losses, the error, the steps
    taken)."""
    engine = dtrain.init(strategy="ddp", seed=0, log_every=4)
    model = DigitsMLP(hidden=4)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rank = dist.get_rank()
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    scaled = lambda out, y: F.cross_entropy(out, y) * (rank + 1)  # noqa: E731
    for _ in range(3):
        mine = engine.train_step(batch, scaled)
    read = engine.check_loss()
    everyone: list[Any] = [None] * 2
    dist.all_gather_object(everyone, mine.item())
    start = engine.step

    def bad(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        infinite = engine.step - start == 2 - rank  # rank 1: step 5, rank 0: step 6
        return F.cross_entropy(out, y) * (float("inf") if infinite else 1.0)

    with pytest.raises(dtrain.NonFiniteLossError) as error:
        for _ in range(5):  # read at step 8
            engine.train_step(batch, bad)
    steps = engine.step - start
    del model, optimizer
    finish(engine, close=False)
    return {"read": read, "mean": sum(everyone) / 2, "error": str(error.value), "steps": steps}


def copies_read(strategy: str, **options: Any) -> dict[str, Any]:
    """Under a layout whose ranks all hold the batch's loss (tensor, pipeline: dp 1), a
    read's collectives (none: every rank reads its own copy) and the losses it read on
    this rank against those the steps returned."""
    from dtrain.models.gpt import GPT, SIZES, lm_loss

    engine = dtrain.init(strategy=strategy, seed=0, log_every=1000, **options)
    model = GPT(SIZES["tiny"])
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    returned = [engine.train_step((tokens[:, :-1], tokens[:, 1:]), lm_loss) for _ in range(3)]
    collectives = 0
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal collectives
        collectives += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        read = engine.check_loss()
    finally:
        dist.all_reduce = original
    everyone: list[Any] = [None] * 2
    dist.all_gather_object(everyone, returned[-1].item())
    del model, optimizer
    finish(engine, close=False)
    return {"collectives": collectives, "read": read, "returned": everyone}


class SkipsALayer(nn.Module):
    """Two layers; `skip` leaves the second out of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 3), nn.Linear(4, 3)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) if self.skip else self.first(x) + self.second(x)


def unused_refusals() -> list[str]:
    """Under ddp without --find-unused-parameters (the watch asks DDP's reducer, once a
    backward): a layer left out of every micro-batch's loss, then out of the last one only
    (its gradient kept from the first, under no_sync). The messages."""
    messages = []
    for accumulate in (1, 2):
        engine = dtrain.init(strategy="ddp", seed=0, grad_accumulation=accumulate)
        model = SkipsALayer()
        wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        batch = (torch.randn(4, 4), torch.randint(0, 3, (4,)))
        engine.train_step(batch, F.cross_entropy)  # every layer in the loss: no refusal
        if accumulate == 1:
            model.skip = True
        else:  # the first micro-batch's forward uses it, the second leaves it out
            model.skip = True
            model.register_forward_pre_hook(lambda m, _: setattr(m, "skip", not m.skip))
        with pytest.raises(dtrain.SetupError) as refused:
            engine.train_step(batch, F.cross_entropy)
        messages.append(str(refused.value))
        del wrapped, optimizer
        finish(engine, close=False)
    return messages


def two_process_reads() -> dict[str, Any]:
    """`count_reads` under ddp, then under zero3 clipping, `ranks_losses`, then
    `step_files` under each of TWO_PROCESS_STEPS, in one process group."""
    return {
        "ddp": count_reads("ddp", close=False),
        "zero3": count_reads("zero3", 10, 0.5, close=False),
        "losses": ranks_losses(),
        "unused": unused_refusals(),
        "copies": {
            "tensor": copies_read("tensor"),
            "pipeline": copies_read("pipeline", microbatches=2),
        },
        "files": {
            name: step_files(close=i == len(TWO_PROCESS_STEPS) - 1, strategy=name, **options)
            for i, (name, options) in enumerate(TWO_PROCESS_STEPS.items())
        },
    }


@pytest.fixture(scope="module")
def two_processes() -> list[dict[str, Any]]:
    """`two_process_reads()` by rank."""
    return run_ranks(two_process_reads, 2, timeout=180)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_processes_read_the_loss_once_per_log_interval(
    strategy: str, two_processes: list[dict[str, Any]]
) -> None:
    assert [reads[strategy] for reads in two_processes] == [STEPS // 10] * 2


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_ranks_holding_copies_of_the_loss_read_it_without_a_collective(
    strategy: str, two_processes: list[dict[str, Any]]
) -> None:
    """Tensor-parallel ranks and pipeline stages all hold the batch's loss: a read is the
    rank's own, the same on both, and what the last step returned."""
    reads = [result["copies"][strategy] for result in two_processes]
    assert [r["collectives"] for r in reads] == [0, 0]
    for r in reads:
        assert r["returned"][0] == pytest.approx(r["returned"][1], rel=1e-6)
        assert r["read"] == pytest.approx(r["returned"][0], rel=1e-6)


def test_one_step_opens_at_most_six_files_in_one_process() -> None:
    for strategy in ("single", "towers"):
        found = step_files(strategy=strategy)
        assert found.keys() == {"train_step", "hand"}
        assert not too_many(strategy, found), (strategy, found)
    # The counter sees past the dispatcher only what it must: single's own step.
    assert step_files()["train_step"] == [
        "engine/engine.py",
        "observe/events.py",
        "step/batches.py",
        "strategies/base.py",
    ]


@pytest.mark.timeout(200)
def test_a_read_is_the_ranks_mean_and_a_non_finite_loss_is_named_with_its_rank(
    two_processes: list[dict[str, Any]],
) -> None:
    for result in two_processes:
        losses = result["losses"]
        assert losses["read"] == pytest.approx(losses["mean"], rel=1e-6)
        assert "The loss is inf at step 5 on rank 1" in losses["error"]  # the first of two
        assert losses["steps"] == 4, "the step that read the losses took no update"


@pytest.mark.timeout(200)
def test_a_layer_left_out_of_the_loss_is_refused_by_name_under_ddp(
    two_processes: list[dict[str, Any]],
) -> None:
    for result in two_processes:
        for message in result["unused"]:  # left out of every micro-batch, of the last one
            assert message.startswith("Parameter(s) second.weight, second.bias got no gradient")
            assert "--find-unused-parameters" in message


@pytest.mark.timeout(200)
def test_one_step_opens_at_most_six_files_under_each_multi_process_strategy(
    two_processes: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(two_processes):
        for strategy, found in result["files"].items():
            assert not too_many(strategy, found), (
                f"rank {rank}, {strategy}: more than {MOST_FILES} files (the exceptions in "
                f"tests/step_files.py aside): {found}"
            )


def nan_at_step_three(tmp: Path) -> tuple[str, bool]:
    """A loss that turns NaN at step 3 with --log-every 5: (the error, whether the save
    attempted at step 4 left a checkpoint)."""
    engine = dtrain.init(strategy="single", log_every=5)
    model = DigitsMLP(hidden=4)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scale = float("nan") if engine.step == 2 else 1.0
        return F.cross_entropy(out, y) * scale

    for _ in range(3):
        engine.train_step(batch, loss_fn)
    with pytest.raises(dtrain.NonFiniteLossError) as error:
        engine.save(tmp / "ckpt")
    return str(error.value), (tmp / "ckpt").exists()


def test_a_non_finite_loss_between_reads_is_named_and_never_saved(tmp_path: Path) -> None:
    message, saved = nan_at_step_three(tmp_path)
    assert "The loss is nan at step 3" in message
    assert not saved


def test_a_non_finite_loss_is_caught_at_the_log_interval() -> None:
    engine = dtrain.init(strategy="single", log_every=4)
    model = DigitsMLP(hidden=4)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    bad = lambda out, y: F.cross_entropy(out, y) * (float("inf") if engine.step == 1 else 1.0)  # noqa: E731
    for _ in range(3):
        engine.train_step(batch, bad)
    with pytest.raises(dtrain.NonFiniteLossError, match="The loss is inf at step 2"):
        engine.train_step(batch, bad)
    assert engine.step == 3, "the step that read the loss took no update"


def test_a_read_writes_its_metrics_after_the_update_it_checked() -> None:
    """The read itself comes before the update (a non-finite loss never reaches it); the
    writing of its metrics waits for the end of the step, so that on a GPU the update is
    queued while the host writes, and the gradient norm logged is the step's own (its
    clipping comes after the read)."""
    engine = dtrain.init(strategy="single", log_every=2, clip_grad_norm=1.0)
    model = DigitsMLP(hidden=4)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    order: list[str] = []
    norms: list[float] = []
    optimizer.register_step_post_hook(lambda *_: order.append("update"))
    log = engine.report.log

    def logged(metrics: dict[str, float], step: int) -> None:
        order.append(f"log {step}")
        norms.append(metrics["train/grad_norm"])
        log(metrics, step)

    engine.report.log = logged
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    for step in range(1, 5):
        engine.train_step((batch[0] * step, batch[1]), F.cross_entropy)
        if step % 2 == 0:
            assert norms[-1] == float(engine.grad_norm)
    assert order == ["update", "update", "log 2", "update", "update", "log 4"]
    assert norms[0] != norms[1]
    engine.close()
