"""The step breakdown, the diagnosis and the trace: planted causes named first, parts that
add up to the step, every rank's spans in the trace."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.autograd import Variable
from torch.utils.data import Dataset

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPTConfig
from dtrain.observe import flops
from dtrain.observe.breakdown import PHASES, StepTimer
from dtrain.observe.clock import HostClock, Mark
from dtrain.observe.diagnosis import Job, diagnose, table
from dtrain.observe.events import Observer, Observers
from dtrain.observe.flops import flops_per_token, gpt_throughput
from dtrain.observe.trace import trace_events

STEPS = 16


class Samples(Dataset):
    """Random digits-like samples; with `delay`, each one takes that long to make."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return torch.randn(64), torch.tensor(i % 10)


def planted(cause: str, out: str) -> dict:
    """Train STEPS steps of ddp with one cause planted; return the timing results (rank 0;
    {} elsewhere). The last cause closes the engine, writing the metrics JSON and trace."""
    last = cause == "communication"
    engine = dtrain.init(
        strategy="ddp",
        seed=0,
        metrics_json=f"{out}/metrics.json" if last else None,
        trace=f"{out}/trace.json" if last else None,
        trace_steps="2:8",
    )
    width = 2048 if cause == "communication" else 64
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = engine.setup(model, optimizer)
    per_rank = 2 if cause == "communication" else 16
    data = Samples(delay=0.002 if cause == "data" else 0.0)
    loader = engine.dataloader(data, batch_size=per_rank)
    for batch in engine.progress(loader):
        engine.train_step(batch, F.cross_entropy)
        if cause == "straggler" and engine.rank == 1:
            time.sleep(0.03)
        if engine.step == STEPS:
            break
    del model, optimizer
    if last:
        engine.close()
        return json.loads(Path(out, "metrics.json").read_text()) if engine.is_main else {}
    results = engine.timing.finish(engine.strategy.placement.train_group, engine.is_main)
    engine.strategy.close()
    return results


def planted_causes(out: str) -> dict[str, dict]:
    return {c: planted(c, out) for c in ("straggler", "data", "communication")}


@pytest.mark.timeout(180)
def test_planted_causes_are_named_first_and_the_trace_holds_every_rank(tmp_path: Path) -> None:
    results = run_ranks(planted_causes, 2, str(tmp_path), timeout=170)[0]
    for cause, result in results.items():
        first = result["diagnosis"][0]
        assert first["cause"] == cause, (cause, result["diagnosis"])
        assert first["rank"] == (1 if cause == "straggler" else None)
        assert "ms" in first["message"]
        assert len(result["breakdown"]) == 2
        for part in result["breakdown"]:
            assert set(part) == set(PHASES)
            parts = sum(part[p] for p in PHASES if p != "step")
            assert parts == pytest.approx(part["step"], rel=0.1), (cause, part)
    assert results["communication"]["strategy"] == "ddp"  # the metrics JSON itself
    assert all(peak > 2**20 for peak in results["communication"]["peak_memory_bytes"])
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["args"]["step"] for e in spans} == set(range(3, 9))
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"forward", "backward", "communication", "optimizer", "data"} <= names


def test_each_rule_names_its_cause_with_the_figures() -> None:
    quiet = dict(data=0.001, forward=0.01, backward=0.02, communication=0.002, optimizer=0.001)
    quiet["other"] = 0.001
    quiet["step"] = sum(quiet.values())
    assert diagnose([quiet, quiet]) == []
    late = {**quiet, "other": 0.05, "step": quiet["step"] + 0.05}
    waiting = {**quiet, "communication": 0.052, "step": quiet["step"] + 0.05}
    [slow] = diagnose([waiting, late, waiting])
    assert slow["cause"] == "straggler" and slow["rank"] == 1
    assert "Rank 1 is busy 83.0 ms" in slow["message"]
    hungry = {**quiet, "data": 0.04, "step": quiet["step"] + 0.039}
    assert diagnose([hungry])[0]["cause"] == "data"
    chatty = {**quiet, "communication": 0.05, "step": quiet["step"] + 0.048}
    causes = diagnose([chatty, chatty], per_device_batch=4)
    assert [c["cause"] for c in causes] == ["communication", "small-batch"]
    [cut, *_] = diagnose([chatty, chatty], job=Job("zero3", cp=2))
    assert "a lower --cp than 2" in cut["message"]  # the keys and values are what cross
    [split, *_] = diagnose([chatty, chatty], job=Job("zero3", ep=2))
    assert "a lower --ep than 2" in split["message"]  # the tokens are what cross
    full = diagnose([quiet], memory=[(95 * 2**30, 100 * 2**30)])
    assert full[0]["cause"] == "memory" and full[0]["rank"] == 0
    assert "dtrain: what to change" in table([chatty], causes)


class TickClock(HostClock):
    """A clock whose n-th mark reads n seconds."""

    def __init__(self) -> None:
        self.origin = 0.0
        self.ticks = 0

    def mark(self, again: Mark | None = None) -> Mark:
        self.ticks += 1
        return float(self.ticks)


def test_a_backward_marks_its_gradients_once_the_last_record_winning() -> None:
    clock = TickClock()  # the n-th mark reads n seconds
    timer = StepTimer(clock)
    timer.begin_step(1)  # 1
    timer.begin_micro()  # 2
    timer.forward_done()  # 3
    timer.grad_ready()  # 4: a pipeline's first chunk
    timer.grad_ready()  # 5: its last
    timer.end_micro()  # 6
    timer.begin_step(2)  # 7
    timer.begin_micro()  # 8
    timer.forward_done()  # 9
    timer.end_micro()  # 10: no mark (nothing to compute): backward runs to its end
    timer.begin_step(3)  # 11
    timer.collect()
    assert list(timer.times["backward"]) == [2.0, 1.0]
    assert list(timer.times["communication"]) == [1.0, 0.0]


def test_the_first_steps_then_a_spread_quarter_are_timed_alike_on_every_rank() -> None:
    """A step that is not timed records no mark (on a GPU, no CUDA event) and costs the
    host only the check; the medians come from the steps that are. Every step of the
    trace window is timed."""

    def run(trace_window: tuple[int, int] | None = None) -> tuple[StepTimer, TickClock]:
        clock = TickClock()
        timer = StepTimer(clock, trace_window=trace_window)
        for number in range(1, 1001):
            timer.begin_step(number)
            timer.begin_micro()
            timer.forward_done()
            timer.end_micro()
            timer.optimizer_mark()
            timer.optimizer_mark()
            timer.data_wait(0.0, 0.0)
            if number % 10 == 0:
                timer.collect()  # as the loss reads do
        timer.collect(final=True)
        return timer, clock

    timer, clock = run()
    timed = len(timer.times["step"])
    untimed = StepTimer(TickClock())
    for number in range(1, 60):  # a micro-batch opens and closes on untimed steps too
        untimed.begin_step(number)
        untimed.begin_micro()
        assert untimed.in_micro
        untimed.end_micro()
        assert not untimed.in_micro
    assert 20 + 0.2 * 980 < timed < 20 + 0.3 * 980
    # A timed step: 6 marks (the next step's start ends it); an untimed one none, unless
    # it ends a timed one.
    assert clock.ticks < 7 * timed + 1
    assert all(len(timer.times[p]) == timed for p in PHASES)
    again, _ = run()
    assert list(again.times["step"]) == list(timer.times["step"])  # the same steps
    traced, _ = run(trace_window=(500, 600))
    assert len(traced.times["step"]) >= timed + 100 * 0.7
    assert {s[1] for s in traced.spans} == set(range(501, 601))
    # The medians come from the sampled steps only: the first and the traced ones that are
    # not in the sample (here slower, and most of the timed steps) weigh nothing once 20
    # sampled ones ran.
    clock = TickClock()
    slow = StepTimer(clock, trace_window=(100, 900))
    for number in range(1, 1001):
        slow.begin_step(number)  # the clock reads the step's start
        sampled = (number * (5**0.5 - 1) / 2) % 1.0 < 0.25  # the rule docs/timing.md gives
        clock.ticks += 1 if sampled else 100
    slow.collect(final=True)
    medians = slow.medians()
    assert medians is not None and medians["step"] < 10


class _Ready(Observer):
    def __init__(self, order: list[str], params: list[nn.Parameter]) -> None:
        self.order, self.params = order, params

    def on_grad_ready(self) -> None:
        assert all(p.grad is not None for p in self.params)
        self.order.append("ready")


def test_gradients_are_ready_once_a_backward_before_the_exchange_waits() -> None:
    """One call a backward, not one a parameter: autograd's pass is over (every gradient
    accumulated), and it comes before the callbacks DDP and FSDP queue during backward to
    wait for their exchange, FSDP's from a hook on the model's output even where that
    output is the loss itself."""
    order: list[str] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    params = list(model.parameters())
    observers = Observers([_Ready(order, params)])

    def exchange(tag: str) -> Callable[..., None]:
        return lambda *_: Variable._execution_engine.queue_callback(lambda: order.append(tag))

    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: order.append("grad"))
    params[0].register_post_accumulate_grad_hook(exchange("ddp"))  # at its last bucket
    for _ in range(2):
        loss = model(torch.randn(3, 4)).sum()
        loss.register_hook(exchange("fsdp"))  # FSDP's hook on the root's output
        observers.watch_backward(loss).backward()
    assert order == 2 * (["grad"] * len(params) + ["ready", "fsdp", "ddp"])
    leaf = torch.ones((), requires_grad=True)
    for _ in range(3):  # a leaf keeps no hook from one backward to the next
        observers.watch_backward(leaf).backward()
    assert order.count("ready") == 5


def test_collectives_inside_forward_and_backward_count_as_communication() -> None:
    clock = TickClock()  # the n-th mark reads n seconds
    timer = StepTimer(clock)
    timer.begin_step(1)  # 1
    timer.begin_micro()  # 2
    timer.collective_begin()  # 3: a gather of keys and values in forward
    timer.collective_end()  # 4
    timer.forward_done()  # 5
    timer.collective_begin()  # 6: gathered again in backward's recompute
    timer.collective_end()  # 7
    timer.collective_begin()  # 8: their gradients reduce-scattered
    timer.collective_end()  # 9
    timer.grad_ready()  # 10
    timer.end_micro()  # 11
    timer.begin_step(2)  # 12
    timer.collect()
    # forward 2..5 less 1 s of gathering; backward 5..10 less 2 s; 1 s after the last
    # gradient, and the 3 s of collectives
    assert list(timer.times["forward"]) == [2.0]
    assert list(timer.times["backward"]) == [3.0]
    assert list(timer.times["communication"]) == [4.0]
    assert list(timer.times["step"]) == [11.0]


def test_trace_events_are_chrome_complete_events() -> None:
    events = trace_events([[("forward", 3, 0.5, 0.25)], []])
    [span] = [e for e in events if e["ph"] == "X"]
    assert span == {
        "name": "forward",
        "cat": "step",
        "ph": "X",
        "pid": 0,
        "tid": 0,
        "ts": 500000.0,
        "dur": 250000.0,
        "args": {"step": 3},
    }
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "rank 0",
        "rank 1",
    }


def traced_run(path: Path, window: str, by_hand: bool) -> set[int]:
    """Train 5 steps of `single` with `--trace path --trace-steps window`, with
    `train_step` or a hand-written loop; return the steps the trace's events carry."""
    engine = dtrain.init(strategy="single", seed=0, trace=str(path), trace_steps=window)
    model = nn.Linear(64, 10)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    assert optimizer is not None
    for batch in engine.dataloader(Samples(), batch_size=8):
        if by_hand:
            inputs, labels = batch
            engine.backward(F.cross_entropy(model(inputs), labels))
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.train_step(batch, F.cross_entropy)
        if engine.step == 5:
            break
    engine.close()
    events = json.loads(path.read_text())["traceEvents"]
    return {e["args"]["step"] for e in events if e["ph"] == "X"}


@pytest.mark.parametrize("by_hand", [False, True], ids=["train_step", "by-hand"])
def test_the_trace_line_names_the_steps_its_events_carry_as_the_progress_bar_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], by_hand: bool
) -> None:
    assert traced_run(tmp_path / "trace.json", "2:4", by_hand) == {3, 4}
    assert "dtrain: trace of steps 3 to 4 in " in capsys.readouterr().out
    assert traced_run(tmp_path / "late.json", "8:9", by_hand) == set()
    assert "holds no step: the run ended before step 9" in capsys.readouterr().out


@pytest.mark.parametrize("window", ["5", "8:3", "a:b", "-1:4"])
def test_a_malformed_trace_window_is_refused(window: str) -> None:
    with pytest.raises(ConfigError, match="--trace-steps must be A:B"):
        Config(trace="t.json", trace_steps=window)


def test_gpt_tokens_per_second_and_model_flops_utilisation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = GPTConfig(dim=64, layers=2, heads=4, context=64)
    assert flops_per_token(config, 1000) == 6 * 1000 + 12 * 2 * 64 * 64
    on_cpu = gpt_throughput(config, 1000, 10.0, 2, torch.device("cpu"), "fp32")
    assert on_cpu == {"tokens_per_second": 640.0, "model_flops_utilisation": None}
    monkeypatch.setattr(flops, "peak_flops", lambda device, precision: 1e9)
    known = gpt_throughput(config, 1000, 10.0, 2, torch.device("cpu"), "fp32")
    assert known["model_flops_utilisation"] == pytest.approx(640 * 104304 / 2e9)


def test_a_loop_without_progress_still_reports_samples_per_second(tmp_path: Path) -> None:
    """Without engine.progress there is no timed loop to count samples over; the metrics
    JSON then gets the steady rate: the global batch over the median step."""
    metrics = tmp_path / "metrics.json"
    engine = dtrain.init(strategy="single", seed=0, metrics_json=str(metrics))
    model = nn.Linear(64, 10)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for step, batch in enumerate(engine.dataloader(Samples(), batch_size=16)):
        engine.train_step(batch, F.cross_entropy)
        if step == 9:
            break
    engine.close()
    result = json.loads(metrics.read_text())
    median_step = result["breakdown"][0]["step"]
    assert result["samples_per_second"] == pytest.approx(16 / median_step)


def test_a_loop_calling_its_model_twice_counts_its_batch_once_on_untimed_steps_too(
    tmp_path: Path,
) -> None:
    """A hand-written step's samples are those of the model's first call before its
    backward (a second call, as a siamese or an auxiliary forward makes, opens nothing),
    whether the step is timed or not: 41 steps end on an untimed one."""
    metrics = tmp_path / "metrics.json"
    engine = dtrain.init(strategy="single", seed=0, metrics_json=str(metrics))
    model = nn.Linear(64, 10)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(41):
        loss = F.cross_entropy(model(x), y) + F.cross_entropy(model(x.flip(0)), y.flip(0))
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    engine.close()
    result = json.loads(metrics.read_text())
    assert result["steps"] == 41 and result["global_batch_size"] == 16
