"""How an Engine is put together around its strategy, and taken apart: fp16-mixed's loss
scale, the observers that watch its run (built once, in the order they are told each
event; the strategy's own figures among them), the line `engine.setup` says, and the end
of `engine.close`."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import Config
from dtrain.engine.checkpoints import Checkpoints
from dtrain.engine.data_side import TrainedSamples
from dtrain.observe.events import End, Observer, Observers
from dtrain.observe.gpu_use import GpuUse
from dtrain.observe.loss_reads import LossReads
from dtrain.observe.memory import MemoryReport
from dtrain.observe.metrics import format_table
from dtrain.observe.progress import Throughput
from dtrain.observe.run_report import RunReport
from dtrain.observe.summary import RunSummary
from dtrain.observe.timing import RunTiming
from dtrain.process.topology import Topology
from dtrain.step.position import Position
from dtrain.step.precision import LossScaling
from dtrain.strategies.base import Strategy


def loss_scaling(config: Config, strategy: Strategy) -> LossScaling | None:
    """fp16-mixed's loss scale over the processes that train together; None under the
    other precisions."""
    if config.precision != "fp16-mixed":
        return None
    distributed = strategy.spec.multiprocess and dist.is_initialized()
    return LossScaling(strategy.placement.input_device, distributed)


class StrategyFigures(Observer):
    """The strategy's own measurements at the end of the run (a pipeline's stages and their
    compute time, the parameter servers' counters, local SGD's syncs: `strategy.figures()`)
    added to the results, under `dtrain run` as under `dtrain demo`, and printed by the
    main rank when there is more to say than the layout the setup line gave."""

    def __init__(self, strategy: Strategy, is_main: bool) -> None:
        self.strategy = strategy
        self.is_main = is_main

    def on_close(self, end: End) -> None:
        if not end.together:
            return  # the figures are gathered over every rank
        figures = self.strategy.figures()
        end.results.update(figures)
        if self.is_main and figures.keys() - {"layout"}:
            table = format_table(list(figures.items()))
            print(f"dtrain: measured by strategy {self.strategy.name}\n{table}", flush=True)


@dataclass(frozen=True)
class Watchers:
    """The Engine's observers, and the list that tells them each event (`observers`)."""

    checkpoints: Checkpoints
    report: RunReport
    timing: RunTiming
    loss: LossReads
    memory: MemoryReport
    observers: Observers


def watchers(
    config: Config,
    topology: Topology,
    strategy: Strategy,
    position: Position,
    throughput: Throughput,
    scaling: LossScaling | None,
) -> Watchers:
    """The observers of one Engine, in the order `Observers` explains."""
    checkpoints = Checkpoints(strategy, position, scaling)
    report = RunReport(config, topology.is_main)
    timing = RunTiming(
        config,
        topology.device,
        topology.is_main,
        strategy.spec.exchange_in_step,
        strategy.placement.coupling.exchange_after_backward,
    )
    loss = LossReads(config.log_every, report, throughput, timing.timer)
    memory = MemoryReport(config.memory_report, topology.rank, topology.is_main)
    dp_size = strategy.placement.dp_size
    summary = RunSummary(
        config, report, throughput, position, timing, scaling, dp_size, topology.is_main
    )
    spec = strategy.spec
    more = "--nproc" if spec.multiprocess else "--strategy ddp --nproc"
    more = "--towers" if spec.name == "towers" else more
    gpus = GpuUse(strategy.placement.devices, topology.is_main, more)
    figures = StrategyFigures(strategy, topology.is_main)
    watched = [checkpoints, report, loss, timing, memory, gpus, figures, summary]
    observers = Observers([TrainedSamples(position), *watched])
    return Watchers(checkpoints, report, timing, loss, memory, observers)


def banner(
    strategy: Strategy, world_size: int, optimizer: torch.optim.Optimizer | None, kind: str
) -> str:
    """The line `engine.setup` says: the strategy, its layout, the device and the
    optimizer (`kind`: the user's class, whatever the strategy returned)."""
    layout = strategy.placement.layout_text
    lrs = sorted({g["lr"] for g in optimizer.param_groups}) if optimizer else []
    return (
        f"dtrain: strategy {strategy.name}, {world_size} process(es)"
        + (f" ({layout})" if layout else "")
        + f", device {strategy.placement.input_device.type}"
        + (f", {kind} lr {', '.join(f'{lr:g}' for lr in lrs)}" if lrs else "")
    )


def release(strategy: Strategy, wrapped: weakref.ref[nn.Module] | None) -> None:
    """Release the strategy's wrappers, then leave the process group, but only once the
    wrapped model (`wrapped`, which the caller no longer holds) is gone: destroying the
    group under a live DDP object can abort the process on gloo."""
    strategy.close()
    if not dist.is_initialized():
        return
    if wrapped is None or wrapped() is not None:
        gc.collect()  # a reference cycle may be all that still holds the model
    if wrapped is None or wrapped() is None:
        dist.destroy_process_group()
