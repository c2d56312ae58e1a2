"""How many of dtrain's source files a reader opens to follow one training step.

`files_of_step(step)` runs `step` under a profiler and names the dtrain modules whose
functions ran. Observers are subscribers: a call made while the `Observers` dispatcher
(observe/events.py) is on the stack counts as events.py, not as its own file, since a
reader of the step sees only the event fired there. Every other call counts, including
hooks torch runs (a parameter's gradient hook, an optimizer's step hook), except the
bundled models' (models/): the model is the user's code, not the step's machinery.

`step_files(**options)` measures one `train_step` and one hand-written step (forward,
`engine.backward`, ``optimizer.step()``) of a tiny model under `options`, each after two
of the same kind, so that what runs once (setup, the first step's measurements) is not
counted.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from training import finish

import dtrain
from dtrain.models.gpt import GPT, SIZES, lm_loss

SOURCE = str(Path(__file__).resolve().parent.parent / "src" / "dtrain") + "/"
DISPATCHER = "observe/events.py"

MOST_FILES = 6
"""The most source files one step under any strategy may take a reader through."""

MORE_FILES = {"pipeline": 8, "ps": 9}
"""The strategies whose step is a subsystem of its own, and the files it takes: a pipeline
runs the stages' schedule (parallel/pipeline.py), its order of micro-batches
(parallel/schedule.py) and the stages' modules (parallel/split.py); a parameter-server
worker pushes and pulls through its client (strategies/ps/client.py), over the wire
format (ps/protocol.py), from its flat parameters (ps/storage.py), stepping the
servers' optimizer (ps/optimizer.py)."""

USERS = ("models/",)
"""Modules of the user's side, not counted."""


def _module(frame: FrameType) -> str | None:
    """The dtrain module (relative to src/dtrain) whose code `frame` runs, if any."""
    name = frame.f_code.co_filename
    if not name.startswith(SOURCE):
        return None
    module = name[len(SOURCE) :]
    return None if module.startswith(USERS) else module


def files_of_step(step: Callable[[], Any]) -> list[str]:
    """The dtrain modules a call of `step` runs code of, counted as the module docstring
    says (sorted)."""
    found: set[str] = set()

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call" or (module := _module(frame)) is None:
            return
        outer = frame.f_back
        while outer is not None:
            if _module(outer) == DISPATCHER:
                module = DISPATCHER
                break
            outer = outer.f_back
        found.add(module)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(found)


def step_files(close: bool = True, gpt: bool = False, **options: Any) -> dict[str, list[str]]:
    """`files_of_step` of a `train_step` and, unless the strategy refuses one (a
    pipeline), of a hand-written step, on a small MLP (the tiny GPT with `gpt`) under
    `options` (given to dtrain.init). `close=False` keeps the process group."""
    engine = dtrain.init(seed=0, **options)
    if gpt:
        model: nn.Module = GPT(SIZES["tiny"])
        tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
        batch, loss_fn = (tokens[:, :-1], tokens[:, 1:]), lm_loss
    else:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        batch, loss_fn = (torch.randn(8, 8), torch.randint(0, 4, (8,))), F.cross_entropy
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert optimizer is not None
    found = _measure(engine, model, optimizer, batch, loss_fn)
    del model, optimizer
    finish(engine, close)
    return found


def _measure(
    engine: dtrain.Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
) -> dict[str, list[str]]:
    """`files_of_step` of `step_files`'s steps, each after two of its kind."""

    def train_step() -> None:
        engine.train_step(batch, loss_fn)

    def hand_step() -> None:
        inputs, targets = engine.to_device(batch)
        engine.backward(loss_fn(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()

    steps = {"train_step": train_step}
    if engine.strategy.name != "pipeline":  # which refuses engine.backward
        steps["hand"] = hand_step
    found = {}
    for kind, step in steps.items():
        step()
        step()
        found[kind] = files_of_step(step)
    return found


def too_many(strategy: str, found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The steps of `found` (`step_files` under `strategy`) that open more files than
    the strategy may."""
    most = MORE_FILES.get(strategy, MOST_FILES)
    return {kind: files for kind, files in found.items() if len(files) > most}
