"""Calibration by measurement: how fast the device trains the model, and what it weighs.

A few seconds on the actual device, in this process:

- the compute probe: forward + loss + backward, and the optimizer step, timed at each
  per-device batch and thread count the candidate layouts need (the median of repeats
  after a warm-up), so the small-batch inefficiency of a split batch is measured rather
  than assumed;
- FLOPs per sample (`torch.utils.flop_counter.FlopCounterMode`), for the achieved rate;
- bytes: parameters, gradients (fp32, as dtrain trains by default), the optimizer's state
  after one step of the chosen optimizer, and the activations autograd saves for backward
  per sample (counted as they are saved, weights excluded);
- per layer of the model's pipeline chain: its share of the forward time, of the saved
  activations and its output's bytes (what a stage boundary sends).

On the CPU, every process of a multi-process layout runs cores / processes threads (the
launcher's rule), so the probe times each layout's batch at that thread count.
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from dtrain.plan.source import Source, Workload
from dtrain.tasks import make_optimizer


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step's parts at one batch and thread count."""

    forward: float
    backward: float
    optimizer: float
    data: float = 0.0
    """Loading the batch: a DataLoader over the example samples held in memory."""
    totals: tuple[float, ...] = ()
    """Every timed step's forward + backward + optimizer, sorted (their spread is the
    machine's jitter: other jobs, the scheduler)."""

    @property
    def compute(self) -> float:
        """Forward + backward."""
        return self.forward + self.backward

    @property
    def jitter(self) -> float:
        """The share of time the machine's jitter adds to a step: the mean measured step
        over the lower-quartile step the other terms use, less 1."""
        low = self.forward + self.backward + self.optimizer
        if not self.totals or low <= 0:
            return 0.0
        return max(0.0, sum(self.totals) / len(self.totals) / low - 1)


@dataclass
class LayerFigures:
    """One layer of the model's pipeline chain."""

    name: str
    param_bytes: int
    time_share: float
    """Its share of the model's forward time."""
    activation_share: float
    """Its share of the activation bytes saved for backward."""
    output_bytes_per_sample: float
    """Bytes of its output per sample (sent forward at a stage boundary)."""


@dataclass
class ModelFigures:
    """What the model weighs, measured once."""

    params: int
    param_tensors: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: float
    flops_per_sample: float | None
    tensor_bytes: list[int]
    """Bytes of each parameter tensor (zero1 broadcasts them one by one)."""
    unit_bytes: list[int]
    """Parameter bytes of each FSDP unit: the repeated blocks in order, then the root
    (what is left); each unit is one all-gather and one reduce-scatter."""
    layers: list[LayerFigures] | None = None
    """The pipeline chain, or None when the model has none."""


@dataclass
class Calibration:
    """The device's measured rates for one model."""

    device: str
    figures: ModelFigures
    steps: dict[tuple[int, int, bool], StepTime] = field(default_factory=dict)
    """(per-device batch, threads, beside other ranks) -> measured step parts."""
    copy_bandwidth: float = 0.0
    """Bytes per second of a copy of the parameters on the device (towers' replicas)."""
    overheads: dict[str, float] = field(default_factory=dict)
    """Seconds per step each torch wrapper adds by itself (`dtrain.plan.overheads`)."""
    probe_seconds: float = 0.0

    def step(self, batch: int, threads: int, shared: bool) -> StepTime:
        """The step parts at `batch` and `threads`, alone or `shared` with other ranks
        (measured, or interpolated in the batch between the nearest measured points)."""
        if (batch, threads, shared) in self.steps:
            return self.steps[(batch, threads, shared)]
        points = sorted(
            (b, s) for (b, t, c), s in self.steps.items() if t == threads and c == shared
        )
        if not points:
            raise KeyError(f"no probe at {threads} thread(s)")
        below = [p for p in points if p[0] <= batch][-1:] or points[:1]
        above = [p for p in points if p[0] >= batch][:1] or points[-1:]
        (b0, s0), (b1, s1) = below[0], above[0]
        w = 0.0 if b1 == b0 else (batch - b0) / (b1 - b0)
        return StepTime(
            s0.forward + w * (s1.forward - s0.forward),
            s0.backward + w * (s1.backward - s0.backward),
            s0.optimizer,
            s0.data + w * (s1.data - s0.data),
            s0.totals if w < 0.5 else s1.totals,
        )


def _sync(device: torch.device) -> None:
    # Calibration only: the probe must see the device finish (never on a training step).
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def time_step(
    work: Workload, model: nn.Module, batch: int, device: torch.device, seconds: float
) -> StepTime:
    """Median forward, backward and optimizer seconds of `model` at `batch` samples."""
    inputs, targets = work.batch(batch, device)
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    forwards: list[float] = []
    backwards: list[float] = []
    updates: list[float] = []
    spent, rounds = 0.0, 0
    while rounds < 5 or (spent < seconds and rounds < 50):
        _sync(device)
        t0 = time.perf_counter()
        loss = work.loss_fn(model(inputs), targets)
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        rounds += 1
        if rounds > 2:  # two warm-up rounds
            forwards.append(t1 - t0)
            backwards.append(t2 - t1)
            updates.append(t3 - t2)
            spent += t3 - t0
    totals = tuple(sorted(f + b + u for f, b, u in zip(forwards, backwards, updates, strict=True)))
    return StepTime(
        _low(forwards), _low(backwards), _low(updates), time_loading(work, batch), totals
    )


def time_loading(work: Workload, batch: int) -> float:
    """Seconds to load one batch of `batch` samples with a shuffling DataLoader over the
    example samples in memory (what the demo's loader does each step)."""
    from torch.utils.data import DataLoader, TensorDataset

    inputs, targets = work.batch(max(4 * batch, len(work.inputs)), torch.device("cpu"))
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=batch, shuffle=True,
                        drop_last=True)  # fmt: skip
    times = []
    while len(times) < 8:
        began = time.perf_counter()
        for _ in loader:
            now = time.perf_counter()
            times.append(now - began)
            began = now
    return _low(times[1:])


def _low(times: list[float]) -> float:
    """The lower quartile of `times`: a step as fast as the device runs it when nothing
    else interrupts (a shared machine's other jobs only ever add time)."""
    return statistics.quantiles(times, n=4)[0] if len(times) >= 4 else min(times)


def measure(
    work: Workload,
    points: set[tuple[int, int, bool]],
    device: torch.device,
    source: Source,
    contenders: int,
    seconds: float,
    wrappers: set[str] = frozenset(),  # type: ignore[assignment]
) -> Calibration:
    """Time the model at every (per-device batch, threads, shared) of `points`; weigh it.

    The shared points (the ranks of a multi-process layout) are timed while `contenders`
    helper processes train the same model beside this one (`dtrain.plan.busy`), as the
    other ranks of the job would: on the CPU they share the cores' memory and caches.
    The `wrappers` (ddp, zero2, zero3, tensor) are timed then too, at the middle shared
    batch, on a one-rank group.
    """
    from dtrain.plan.overheads import measure_overheads

    began = time.perf_counter()
    shared = sorted(p for p in points if p[2])
    helpers = _start_helpers(source, shared, contenders)
    model = copy.deepcopy(work.model).to(device)
    figures = weigh(work, model, device, max(p[0] for p in points))
    calibration = Calibration(_describe(device), figures)
    for point in sorted(p for p in points if not p[2]):
        with _threads(point[1]):
            calibration.steps[point] = time_step(work, model, point[0], device, seconds)
    try:
        _wait_ready(helpers)
        for point in shared:
            with _threads(point[1]):
                calibration.steps[point] = time_step(work, model, point[0], device, seconds)
        if shared and wrappers:
            batch, threads, _ = shared[len(shared) // 2]
            with _threads(threads):
                calibration.overheads = measure_overheads(
                    work, device, batch, seconds, set(wrappers)
                )
    finally:
        _stop(helpers)
    calibration.copy_bandwidth = copy_bandwidth(figures.param_bytes, device)
    calibration.probe_seconds = time.perf_counter() - began
    return calibration


def _start_helpers(
    source: Source, shared: list[tuple[int, int, bool]], count: int
) -> list[subprocess.Popen[str]]:
    if not shared or count < 1:
        return []
    batch, threads, _ = shared[len(shared) // 2]
    command = [sys.executable, "-m", "dtrain.plan.busy", str(batch), str(threads), *source.args()]
    return [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]


def _wait_ready(helpers: list[subprocess.Popen[str]]) -> None:
    for helper in helpers:
        assert helper.stdout is not None
        if helper.stdout.readline().strip() != "ready":
            raise RuntimeError("a compute-probe helper process failed to start")


def _stop(helpers: list[subprocess.Popen[str]]) -> None:
    for helper in helpers:
        assert helper.stdin is not None
        helper.stdin.close()
    for helper in helpers:
        try:
            helper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()


def copy_bandwidth(size: int, device: torch.device) -> float:
    """Bytes per second of copying `size` bytes on `device` (median of a few copies)."""
    source = torch.empty(max(size, 2**20) // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(7):
        _sync(device)
        t0 = time.perf_counter()
        target.copy_(source)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return source.numel() * 4 / max(statistics.median(times[2:]), 1e-9)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"cpu ({torch.get_num_threads()} threads)"


def weigh(work: Workload, model: nn.Module, device: torch.device, batch: int) -> ModelFigures:
    """Bytes, FLOPs, blocks and the per-layer figures of `model`."""
    from dtrain.strategies.blocks import find_blocks

    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    inputs, targets = work.batch(batch, device)
    work.loss_fn(model(inputs), targets).backward()
    optimizer.step()
    optimizer_bytes = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    optimizer.zero_grad(set_to_none=True)
    blocks = [
        sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
        for b in find_blocks(model)
    ]
    layers = _chain(model)
    saved, per_layer, outputs, times = _forward_figures(work, model, layers, batch, device)
    total_time = sum(times) or 1.0
    total_saved = sum(per_layer) or 1.0
    chain = None
    if layers is not None:
        chain = [
            LayerFigures(
                name,
                sum(p.numel() * p.element_size() for p in layer.parameters()),
                times[i] / total_time,
                per_layer[i] / total_saved,
                outputs[i] / batch,
            )
            for i, (name, layer) in enumerate(layers)
        ]
    return ModelFigures(
        params=sum(p.numel() for p in params),
        param_tensors=len(params),
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes_per_sample=saved / batch,
        flops_per_sample=_flops_per_sample(work, model, device),
        tensor_bytes=[p.numel() * p.element_size() for p in params],
        unit_bytes=[*blocks, param_bytes - sum(blocks)],
        layers=chain,
    )


def _chain(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    from dtrain.errors import ConfigError
    from dtrain.parallel.split import layers_of

    try:
        return layers_of(model)
    except ConfigError:
        return None


def _forward_figures(
    work: Workload,
    model: nn.Module,
    layers: list[tuple[str, nn.Module]] | None,
    batch: int,
    device: torch.device,
) -> tuple[int, list[float], list[float], list[float]]:
    """(activation bytes saved in all, saved per layer, output bytes per layer, forward
    seconds per layer) of one forward at `batch` samples."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    count = max(len(layers or ()), 1)
    per_layer = [0.0] * count
    outputs = [0.0] * count
    times = [0.0] * count
    current = [0]
    began = [0.0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in seen:
            seen.add(key)
            per_layer[current[0]] += storage.nbytes()
        return t

    def before(i: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            current[0] = i
            _sync(device)
            began[0] = time.perf_counter()

        return hook

    def after(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _in: object, out: object) -> None:
            _sync(device)
            times[i] += time.perf_counter() - began[0]
            if isinstance(out, torch.Tensor):
                outputs[i] += out.numel() * out.element_size()

        return hook

    handles = []
    for i, (_, layer) in enumerate(layers or ()):
        handles.append(layer.register_forward_pre_hook(before(i)))
        handles.append(layer.register_forward_hook(after(i)))
    inputs, targets = work.batch(batch, device)
    try:
        for _ in range(2):  # the second pass is timed warm
            per_layer = [0.0] * count
            outputs = [0.0] * count
            times = [0.0] * count
            seen.clear()
            with saved_tensors_hooks(pack, lambda t: t):
                loss = work.loss_fn(model(inputs), targets)
            del loss
    finally:
        for h in handles:
            h.remove()
    return int(sum(per_layer)), per_layer, outputs, times


def _flops_per_sample(work: Workload, model: nn.Module, device: torch.device) -> float | None:
    """Forward + backward FLOPs of one sample (None where torch cannot count them)."""
    inputs, targets = work.batch(2, device)
    try:
        with FlopCounterMode(display=False) as counter:
            work.loss_fn(model(inputs), targets).backward()
    except Exception:  # an operator the counter does not know: report no FLOPs
        return None
    finally:
        model.zero_grad(set_to_none=True)
    total = counter.get_total_flops()
    return total / 2 if total else None


@dataclass
class TensorFigures:
    """What the model's tensor-parallel plan splits, measured at one forward."""

    time_share: float
    """Share of the forward time spent in the layers the plan splits."""
    forward_bytes_per_sample: list[float]
    """Per row-split layer: its output per sample (all-reduced in forward)."""
    backward_bytes_per_sample: list[float]
    """Per column-split layer: its input per sample (its gradient all-reduced in backward)."""
    param_share: float
    """Share of the parameters in the layers the plan splits."""


def tensor_figures(work: Workload, batch: int, device: torch.device) -> TensorFigures | None:
    """The figures of the model's tensor-parallel plan, or None when it has none."""
    from fnmatch import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dtrain.errors import ConfigError
    from dtrain.parallel.tensor_plan import plan_of

    model = work.model
    try:
        plan = plan_of(model, 1)
    except ConfigError:
        return None
    inputs, targets = work.batch(batch, device)
    model = copy.deepcopy(model).to(device)
    forward_bytes: list[float] = []
    backward_bytes: list[float] = []
    split_time = [0.0]
    began = [0.0]
    handles = []
    split_params = 0
    for name, module in model.named_modules():
        style = next((s for path, s in plan.items() if fnmatch(name, path)), None)
        if style is None:
            continue
        split_params += sum(p.numel() for p in module.parameters())

        def pre(_m: nn.Module, _args: object) -> None:
            _sync(device)
            began[0] = time.perf_counter()

        def post(
            _m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, style: object = style
        ) -> None:
            _sync(device)
            split_time[0] += time.perf_counter() - began[0]
            if isinstance(style, RowwiseParallel):
                forward_bytes.append(out.numel() * out.element_size() / batch)
            elif isinstance(style, ColwiseParallel):
                backward_bytes.append(args[0].numel() * args[0].element_size() / batch)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(inputs)  # warm-up
            forward_bytes.clear()
            backward_bytes.clear()
            split_time[0] = 0.0
            _sync(device)
            t0 = time.perf_counter()
            model(inputs)
            _sync(device)
            whole = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    del targets
    total = sum(p.numel() for p in model.parameters()) or 1
    return TensorFigures(
        min(1.0, split_time[0] / max(whole, 1e-12)),
        forward_bytes,
        backward_bytes,
        split_params / total,
    )
