"""What a real training step costs beyond the model: loading the batch from the data set
and the Engine's own work per step, measured by running them.

The compute probe times the bare model (forward, backward, optimizer) on a batch already
in memory. A step of `dtrain demo` or of a user's loop also fetches its samples one by
one from the data set and collates them (`engine.dataloader`: a sharded batch sampler
over a map-style data set), and the Engine marks the step's phases (a hook on every
parameter), watches the loss, advances the progress bar and the learning-rate schedule.
On a small model that is a large share of the step. Both are timed here:

- loading: the loader `engine.dataloader` builds, over the bundled model's own training
  set (for `--script`/`--factory`, over the example samples), per batch size;
- the Engine's bookkeeping: a few steps of a real one-process Engine (`dtrain.init` with
  strategy single) through `engine.progress` and `engine.train_step`, less the loading and
  the bare step at the same batch (lower quartile against lower quartile, so that the
  machine's jitter, which the cost model counts on its own, falls out). The bookkeeping
  is per step and per parameter tensor, not per sample, so it is applied as it is to
  every rank of every layout.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dtrain.plan.source import Workload


def dataset_of(work: Workload) -> Dataset:
    """The samples a step loads: the bundled model's training set, or the examples."""
    if work.dataset is not None:
        return work.dataset
    inputs, targets = work.batch(max(256, len(work.inputs)), torch.device("cpu"))
    return TensorDataset(inputs, targets)


def endless_batches(work: Workload, batch: int) -> Iterator[object]:
    """Batches of `batch` samples loaded, epoch after epoch, with the loader
    `engine.dataloader` builds (a shuffling sharded batch sampler over the data set)."""
    from dtrain.data.sampler import ShardedBatchSampler

    dataset = dataset_of(work)
    size = len(dataset)  # type: ignore[arg-type]
    sampler = ShardedBatchSampler(size, min(batch, size), seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def time_loading(work: Workload, batch: int, seconds: float) -> float:
    """Lower-quartile seconds to load one batch of `batch` samples (`endless_batches`)."""
    loads = endless_batches(work, batch)
    next(loads)  # the first builds the loader's iterator
    times: list[float] = []
    spent = 0.0
    while len(times) < 9 or (spent < seconds / 4 and len(times) < 200):
        began = time.perf_counter()
        next(loads)
        times.append(time.perf_counter() - began)
        spent += times[-1]
    return lower_quartile(times)


def time_engine_step(work: Workload, batch: int, device: torch.device, seconds: float) -> float:
    """Lower-quartile seconds of one whole step of a real one-process Engine at `batch`
    samples: waiting for the loader, `engine.train_step`, the progress bar. A quantile,
    as for the bare step it is set against: a mean against a mean let one pause of a
    long step (a fifth of a second on the GPT) pass for the Engine's work, 60 ms of it in
    one calibration. The work that comes every few steps (the loss read back every
    `log_every` steps, the bar redrawn twice a second) falls out; it is small. The
    planner's random state is kept as it was (the Engine seeds every generator)."""
    import dtrain
    from dtrain.models.recipes import make_optimizer

    state = random.getstate()
    times: list[float] = []
    quiet = io.StringIO()
    with (
        torch.random.fork_rng(devices=[]),
        tempfile.TemporaryDirectory(prefix="dtrain-plan-engine-") as out,
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
    ):
        engine = dtrain.init(strategy="single", seed=0, out=out, cpu=device.type == "cpu")
        try:
            model = copy.deepcopy(work.model)
            model, optimizer = engine.setup(model, make_optimizer(work.optimizer, model, 1e-12))
            dataset = dataset_of(work)
            loader = engine.dataloader(dataset, batch_size=min(batch, len(dataset)))  # type: ignore[arg-type]
            spent, epoch = 0.0, 0
            while len(times) < 33 or (spent < seconds and len(times) < 200):
                began = time.perf_counter()
                for batch_ in engine.progress(loader, epoch=epoch):
                    engine.train_step(batch_, work.loss_fn)
                    now = time.perf_counter()
                    times.append(now - began)
                    spent += now - began
                    began = now
                    if len(times) >= 200:
                        break
                epoch += 1
        finally:
            engine.close(failed=True)  # no end-of-run summary
    random.setstate(state)
    return lower_quartile(times[3:])  # the first steps build the Engine's caches


def lower_quartile(times: list[float]) -> float:
    """The lower quartile of `times`: a step as fast as the device runs it when nothing
    else interrupts (a shared machine's other jobs only ever add time)."""
    return statistics.quantiles(times, n=4)[0] if len(times) >= 4 else min(times)
