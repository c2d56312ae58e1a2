"""The Engine's step events: an observer added to its list (`dtrain.Observer`, public)
sees them in order, and a step that raises still ends its step (the pair is fired in
try/finally)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dtrain
from dtrain import End, Observer, Run
from dtrain.models import DigitsMLP
from dtrain.step.batches import batch_size

pytestmark = pytest.mark.quick


class Recorder(Observer):
    """Writes down every event it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.results: dict[str, Any] = {}
        self.grads = 0
        """Backwards that computed their gradients since the last micro-batch or backward
        ended; each one seen with every parameter's gradient in place."""
        self.params: list[torch.Tensor] = []

    def on_setup(self, run: Run) -> None:
        self.params = list(run.module.parameters())
        self.events.append(("setup", type(run.optimizer).__name__))

    def on_step_start(self, step: int) -> None:
        self.events.append(("start", step))

    def on_micro_start(self, samples: int) -> None:
        self.events.append(("micro", samples))

    def on_forward_start(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        args, kwargs = call
        self.events.append(("forward", batch_size(args)))

    def on_forward_end(self) -> None:
        self.events.append(("loss",))

    def on_grad_ready(self) -> None:
        assert all(p.grad is not None for p in self.params)  # autograd's pass is over
        self.grads += 1

    def on_micro_end(self) -> None:
        self.events.append(("micro end", self.grads))
        self.grads = 0

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        self.events.append(("gradients", step, loss.dim()))

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        self.events.append(("norm",))

    def on_optimizer_start(self) -> None:
        self.events.append(("optimizer",))

    def on_optimizer_end(self, step: int) -> None:
        self.events.append(("optimizer end", step))

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        self.events.append(("end", step, "failed" if loss is None else "ok"))

    def on_backward_start(self, step: int, loss: torch.Tensor) -> None:
        self.events.append(("backward", step))

    def on_backward_end(self) -> None:
        self.events.append(("backward end", self.grads))
        self.grads = 0

    def on_loop_step(self, step: int) -> None:
        self.events.append(("loop step", step))

    def on_close(self, end: End) -> None:
        self.events.append(("close", end.steps, end.together))
        self.results = dict(end.results)


def _failing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the loss failed")


def test_an_observer_sees_the_events_in_order_and_a_failed_step_still_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.json"
    engine = dtrain.init(
        seed=0,
        grad_accumulation=2,
        clip_grad_norm=1.0,
        memory_report=True,
        metrics_json=str(metrics),
    )
    recorder = Recorder()
    engine.observers.append(recorder)
    model = DigitsMLP(hidden=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped, optimizer = engine.setup(model, optimizer)
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))

    with pytest.raises(RuntimeError, match="the loss failed"):
        engine.train_step((x, y), _failing_loss)
    assert not engine.module._forward_hooks  # the memory report's hook left with the step
    assert engine.memory is None and engine.step == 0  # a failed step is not measured

    loss = engine.train_step((x, y), F.cross_entropy)
    assert loss.dim() == 0 and engine.step == 1
    size = 4 * sum(p.numel() for p in model.parameters())  # fp32: 4 bytes a value
    assert engine.memory == {
        "parameters": size,
        "parameters_in_step": size,
        "gradients": size,
        "optimizer": size,  # SGD's momentum buffers
    }

    # Hand-written steps: their optimizer steps are the loop's, not a train_step's (the
    # failed step above closed its pair); from the first backward on, the forwards too.
    for _ in range(2):
        engine.backward(F.cross_entropy(wrapped(x), y))
        optimizer.step()
        optimizer.zero_grad()
    engine.close()

    params = 1  # one call a backward, once every gradient is computed, not one a parameter
    assert recorder.events == [
        ("setup", "SGD"),
        ("start", 1),
        ("micro", 2),
        ("end", 1, "failed"),
        ("start", 1),
        ("micro", 2),
        ("loss",),
        ("micro end", params),
        ("micro", 2),
        ("loss",),
        ("micro end", params),
        ("gradients", 1, 0),
        ("norm",),
        ("optimizer",),
        ("optimizer end", 1),
        ("end", 1, "ok"),
        ("backward", 2),
        ("backward end", params),
        ("optimizer",),
        ("optimizer end", 2),
        ("loop step", 2),
        ("forward", 4),
        ("backward", 3),
        ("backward end", params),
        ("optimizer",),
        ("optimizer end", 3),
        ("loop step", 3),
        ("close", 3, True),
    ]
    # The observers before it filled the results; the metrics JSON holds the same.
    written = json.loads(metrics.read_text())
    assert recorder.results["global_batch_size"] == written["global_batch_size"] == 4
    assert written["steps"] == 3 and written["memory"] == [dict(engine.memory, rank=0)]
    assert written["train_loss"] == recorder.results["train_loss"]
    said = capsys.readouterr().out
    assert "dtrain: model state per rank" in said and "dtrain: 3 steps" in said


def test_a_step_fp16_mixed_skips_still_pairs_the_optimizer_events() -> None:
    engine = dtrain.init(seed=0, precision="fp16-mixed")
    recorder = Recorder()
    engine.observers.append(recorder)
    model = DigitsMLP(hidden=4)
    wrapped, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))

    def overflowing(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target) * float("inf")

    engine.train_step((x, y), overflowing)
    with engine.autocast():
        loss = overflowing(wrapped(x), y)
    engine.backward(loss)
    optimizer.step()
    assert engine.step == 2 and engine.loss_scaling is not None
    assert engine.loss_scaling.skipped == 2
    engine.close()

    optimizer_events = [e for e in recorder.events if e[0].startswith("optimizer")]
    assert optimizer_events == [
        ("optimizer",), ("optimizer end", 1), ("optimizer",), ("optimizer end", 2)
    ]


def test_the_strategys_figures_reach_the_metrics_of_any_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A strategy's own figures (a pipeline's stage times, the servers' counters) are added
    at close, so a `dtrain run` script's metrics JSON holds them as the demo's does, and
    the main rank prints them; a layout alone is not printed again."""
    metrics = tmp_path / "m.json"
    engine = dtrain.init(seed=0, metrics_json=str(metrics))
    figures = {"layout": "dp1 x pp2", "stages": "a / b", "stage_compute_ms": "1.5 / 2.5"}
    monkeypatch.setattr(engine.strategy, "figures", lambda: figures)
    model = DigitsMLP(hidden=4)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.train_step((torch.randn(4, 64), torch.randint(0, 10, (4,))), F.cross_entropy)
    engine.close()
    written = json.loads(metrics.read_text())
    assert {k: written[k] for k in figures} == figures
    said = capsys.readouterr().out
    assert "dtrain: measured by strategy single" in said and "stage_compute_ms" in said

    engine = dtrain.init(seed=0)
    monkeypatch.setattr(engine.strategy, "figures", lambda: {"layout": "dp2"})
    model = DigitsMLP(hidden=4)
    engine.setup(model, None)
    engine.close()
    assert "measured by strategy" not in capsys.readouterr().out


class Declining(Observer):
    """Overrides two hooks and wants one of them."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def listens_to(self, event: str) -> bool:
        return event != "on_grad_ready"

    def on_step_start(self, step: int) -> None:
        self.steps.append(step)

    def on_grad_ready(self) -> None:
        raise AssertionError("declined, yet told")


@pytest.mark.parametrize("strategy", ["single", "towers"])
def test_a_backward_is_watched_only_where_an_exchange_follows_autograds_pass(
    strategy: str,
) -> None:
    """A watch costs a view and a hook on every backward: under single, whose backward ends
    with autograd's pass, no one wants it (the timing's mark would equal the backward's
    end) until an observer asks; towers sum their gradients after the pass, so the timing
    watches it there."""
    engine = dtrain.init(strategy=strategy, seed=0)
    declining = Declining()
    engine.observers.append(declining)
    model = DigitsMLP(hidden=4)
    engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.randn(4, 64)).sum()
    watched = engine.observers.watch_backward(loss) is not loss
    assert watched == (strategy == "towers")
    engine.train_step((torch.randn(4, 64), torch.randint(0, 10, (4,))), F.cross_entropy)
    assert declining.steps == [1]

    recorder = Recorder()
    engine.observers.append(recorder)  # wants every backward's end: now it is watched
    assert engine.observers.watch_backward(loss) is not loss
    engine.train_step((torch.randn(4, 64), torch.randint(0, 10, (4,))), F.cross_entropy)
    assert ("micro end", 1) in recorder.events
    engine.close()
