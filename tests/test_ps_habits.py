"""Sync ps trains what `single` trains for ordinary habits of training scripts: parameters
that get no gradient (a submodule used every other step, one never used, one that only
some workers' samples reach), frozen parameters inside the optimizer, OneCycleLR cycling
AdamW's betas and SGD's momentum, a loop written by hand that accumulates two backward
passes without `engine.no_sync()` and clips with `engine.clip_grad_norm_`; torch's own
`clip_grad_norm_` is refused by name with several workers (it would clip each worker's
share by its own norm) and applied with one. One spawn runs every habit in turn, the
servers serving one run after another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from test_ps import SERVER, ps_runs
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import dtrain
from dtrain.strategies.ps.client import CHANGED_GRADIENT

STEPS = 5
BATCH = 8  # global; the first half goes to worker 0, the second to worker 1
BOUND = 0.05  # below the gradient norm of every step: clipping changes every update


class Net(nn.Module):
    """A small classifier with parameters that often get no gradient: `sometimes` runs
    while `use_sometimes` is set, `routed` only on samples whose first feature is positive
    (one per global batch, on alternating workers), `never` never runs."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.routed = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.use_sometimes = True
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.to(self.out.weight.dtype)))
        h = h + self.frozen(h)
        if self.use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        routed = x[:, :1] > 0
        if routed.any():
            h = h + routed * self.routed(h)
        return self.out(h)


def samples() -> TensorDataset:
    """STEPS global batches, in order; batch t's one routed sample lies in worker t % 2's
    half."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 8, generator=generator, dtype=torch.float64)
    x[:, 0] = -1.0
    for t in range(STEPS):
        x[t * BATCH + (t % 2) * BATCH // 2 + 1, 0] = 1.0
    return TensorDataset(x, torch.randint(0, 4, (STEPS * BATCH,), generator=generator))


@dataclass(frozen=True)
class Habit:
    """How a script trains: `optimizer` (AdamW or SGD), `one_cycle` ("before" or
    "after" engine.setup, or None), `by_hand` (engine.backward, optimizer.step,
    optimizer.zero_grad), `micro` backward passes per step accumulated by hand, `clip`
    ("engine" or "torch", by hand), `freeze` the `frozen` layer (kept in the optimizer),
    `dtype` of the model (float64 compares exactly; dtrain's clipping takes float32)."""

    optimizer: str = "sgd"
    one_cycle: str | None = None
    by_hand: bool = False
    micro: int = 1
    clip: str | None = None
    freeze: bool = False
    dtype: torch.dtype = torch.float64


HABITS = {
    "unused-adamw": Habit(optimizer="adamw"),
    "unused-sgd-by-hand": Habit(by_hand=True),
    "one-cycle-adamw": Habit(optimizer="adamw", one_cycle="before"),
    "one-cycle-sgd-by-hand": Habit(one_cycle="after", by_hand=True),
    "accumulate-and-clip-by-hand": Habit(by_hand=True, micro=2, clip="engine", dtype=torch.float32),
    "frozen": Habit(optimizer="adamw", freeze=True),
    "torch-clip": Habit(by_hand=True, clip="torch"),
}


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)


def one_cycle(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=STEPS)


def step_by_hand(
    engine: dtrain.Engine, model: nn.Module, optimizer: Any, batch: Any, habit: Habit
) -> None:
    inputs, targets = engine.to_device(batch)
    for x, y in zip(inputs.chunk(habit.micro), targets.chunk(habit.micro), strict=True):
        engine.backward(F.cross_entropy(model(x), y) / habit.micro)
    if habit.clip == "engine":
        engine.clip_grad_norm_(BOUND)
    elif habit.clip == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), BOUND)
    optimizer.step()
    optimizer.zero_grad()


def train(name: str, close: bool = True, **options: Any) -> dict[str, torch.Tensor] | str:
    """STEPS steps of `name`'s habit under `options`: the parameters on the main rank, or
    the message of a refusal."""
    habit = HABITS[name]
    engine = dtrain.init(seed=0, **options)
    model = Net(habit.dtype)
    if habit.freeze:
        model.frozen.requires_grad_(False)
    optimizer = make_optimizer(habit.optimizer, model)
    scheduler = one_cycle(optimizer) if habit.one_cycle == "before" else None
    model, optimizer = engine.setup(model, optimizer)
    if habit.one_cycle == "after":
        scheduler = one_cycle(optimizer)
    loader = engine.dataloader(samples(), batch_size=BATCH // engine.dp_size, shuffle=False)
    outcome: dict[str, torch.Tensor] | str | None = None
    try:
        for batch in engine.progress(loader):
            model.use_sometimes = engine.step % 2 == 0
            if habit.by_hand:
                step_by_hand(engine, model, optimizer, batch, habit)
            else:
                engine.train_step(batch, F.cross_entropy)
            if scheduler is not None:
                scheduler.step()
    except dtrain.ConfigError as e:
        outcome = str(e)
    if outcome is None:
        outcome = engine.state_dict()
    del model, optimizer, scheduler
    if close:
        engine.close()
    else:
        engine.strategy.close()
    return outcome


def test_the_habits_leave_parameters_without_gradients_alone() -> None:
    """Under `single` (the reference) the habits really do skip parameters, so the sync
    ps runs compared with it check that the servers skip them too."""
    engine = dtrain.init(seed=0, strategy="single")
    start = Net()  # as `train` builds it
    engine.close()
    trained = train("unused-adamw", strategy="single")
    assert isinstance(trained, dict)
    assert_close(trained["never.weight"], start.never.weight.detach())  # no weight decay
    assert not torch.equal(trained["sometimes.weight"], start.sometimes.weight.detach())
    frozen = train("frozen", strategy="single")
    assert isinstance(frozen, dict)
    assert_close(frozen["frozen.weight"], start.frozen.weight.detach())
    clipped = train("accumulate-and-clip-by-hand", strategy="single")
    unclipped = train("unused-sgd-by-hand", strategy="single")
    assert isinstance(clipped, dict) and isinstance(unclipped, dict)
    assert not torch.allclose(clipped["out.weight"], unclipped["out.weight"].float()), "unclipped"


@pytest.mark.timeout(150)
def test_sync_ps_trains_as_single_whatever_the_script_does() -> None:
    names = list(HABITS)
    results = run_ranks(ps_runs, 4, train, [{"name": n} for n in names], 2, 2, timeout=140)
    assert results[2:] == [SERVER, SERVER]
    for name, outcome in zip(names, results[0], strict=True):
        if name == "torch-clip":
            assert outcome == CHANGED_GRADIENT
            continue
        expected = train(name, strategy="single")
        # float32: the servers' mean of two workers' gradients rounds otherwise than one sum.
        loose = {"rtol": 1e-5, "atol": 1e-5} if HABITS[name].dtype == torch.float32 else {}
        assert_close(outcome, expected, msg=lambda m, n=name: f"{n}: {m}", **loose)


@pytest.mark.timeout(90)
def test_torch_clip_by_hand_is_applied_with_one_worker() -> None:
    """The gradients go to the server at optimizer.step(), after the script's own
    clipping (one worker's gradient is the whole batch's)."""
    results = run_ranks(ps_runs, 2, train, [{"name": "torch-clip"}], 1, 1, timeout=80)
    assert results[1] == SERVER
    assert_close(results[0][0], train("torch-clip", strategy="single"))
