"""Why a run is not faster, in plain words, from every rank's step breakdown.

Each rule looks at the medians of `dtrain.observe.breakdown` (seconds per step, one dict
per rank) and names one cause with the figures it saw and what to change:

- ``straggler``: one rank is busy (everything but communication) clearly longer than the
  others, who wait for it at every synchronisation;
- ``data``: the loop waits for the next batch for a good share of the step;
- ``communication``: the exchange that compute did not hide (t2 against compute t1);
  across machines it names the flags that send fewer bytes between them and apply to the
  running strategy (`Job`);
- ``small-batch``: each device gets so few samples that fixed costs dominate the step;
- ``memory``: a device ran close to its memory's end.

Causes are ordered by the share of the step they cost, most important first.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from dtrain.config import COMPRESSES_CAST, COMPRESSES_POWERSGD, training_of

SHARE = 0.2
"""A cause is reported when it costs at least this share of the step."""

STRAGGLER_RATIO = 1.5
"""A straggler is busy at least this many times as long as the median of the others."""

SMALL_BATCH = 16
"""Per-device batches below this many samples rarely keep a device busy."""

MEMORY_SHARE = 0.9
"""Peak memory above this share of a device's memory is reported."""


DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "hsdp")
"""Strategies whose every rank holds or gathers a whole replica: local-sgd can replace them."""


@dataclass(frozen=True)
class Job:
    """What the diagnosis knows of the running layout, to advise what applies to it."""

    strategy: str
    nnodes: int = 1
    hierarchical: bool = False
    grad_compression: str = "none"
    half: str = "bf16"
    """The 16-bit format the devices reduce in: bf16, or fp16 on GPUs without bf16."""
    cp: int = 1
    """Context-parallel ranks sharing each sample (--cp)."""
    ep: int = 1
    """Expert-parallel ranks splitting each MoE layer's experts (--ep)."""


@dataclass(frozen=True)
class Reading:
    """How the training loop's loader reads its batches: what the data advice builds on."""

    num_workers: int
    """The DataLoader's worker processes (0: the training process reads)."""
    cores: int
    """CPU cores per training process on this machine."""
    unpinned: bool
    """Batches go to a GPU from pageable host memory (``pin_memory=False``)."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _compute(part: dict[str, float]) -> float:
    """t1: forward and backward compute of one step."""
    return part["forward"] + part["backward"]


def _busy(part: dict[str, float]) -> float:
    """Everything a rank does in a step except waiting in communication."""
    return part["step"] - part["communication"]


def diagnose(
    breakdown: list[dict[str, float]],
    per_device_batch: int | None = None,
    memory: list[tuple[int, int] | None] | None = None,
    grad_accumulation: int = 1,
    job: Job | None = None,
    reading: Reading | None = None,
) -> list[dict[str, Any]]:
    """The causes, most important first: ``{"cause", "rank", "message"}`` each.

    Args:
        breakdown: per rank, seconds per step by phase (`PHASES`).
        per_device_batch: samples each device computes per step, if known.
        memory: per rank, (peak bytes, device bytes) where the device reports them.
        grad_accumulation: the run's micro-batches per exchange (--grad-accumulation).
        job: the running layout, if known (the communication advice across machines).
        reading: how the training loader read its batches, if known (the data advice).
    """
    if not breakdown:
        return []
    found: list[tuple[float, dict[str, Any]]] = []
    step = statistics.median(p["step"] for p in breakdown)
    if step <= 0:
        return []
    slow = _straggler(breakdown, step)
    if slow is not None:
        found.append(slow)
    data = statistics.median(p["data"] for p in breakdown)
    if data >= SHARE * step:
        message = _data_advice(data, step, reading)
        found.append((data / step, {"cause": "data", "rank": None, "message": message}))
    # The rank that arrives last at each exchange waits only for the exchange itself: its
    # wait is the communication proper; the others' waits add a slower rank's lateness.
    t2 = min(p["communication"] for p in breakdown)
    t1 = statistics.median(_compute(p) for p in breakdown)
    if t2 >= SHARE * step:
        found.append(
            (
                t2 / step,
                {
                    "cause": "communication",
                    "rank": None,
                    "message": f"Communication that compute did not hide takes {_ms(t2)} of "
                    f"each {_ms(step)} step, against {_ms(t1)} of forward and backward "
                    "compute (t1): the devices wait for the network. Raise the per-device "
                    f"batch or {_accumulate_more(grad_accumulation)} so each exchange carries "
                    f"more compute, {_fewer_bytes(job)}.",
                },
            )
        )
    if per_device_batch is not None and per_device_batch < SMALL_BATCH and t1 < 0.5 * step:
        found.append(
            (
                # Behind a cause it feeds (communication, other fixed costs): half weight.
                0.5 * (1 - t1 / step),
                {
                    "cause": "small-batch",
                    "rank": None,
                    "message": f"Each device computes {per_device_batch} sample(s) per step, "
                    f"and forward and backward take only {_ms(t1)} of the {_ms(step)} "
                    "step: fixed costs per step dominate. Keep each device's batch large "
                    "(raise the global batch with the number of devices, and the learning "
                    "rate with it) instead of spreading a fixed batch thinner.",
                },
            )
        )
    for rank, usage in enumerate(memory or []):
        if usage is not None and usage[1] > 0 and usage[0] >= MEMORY_SHARE * usage[1]:
            peak, total = usage
            found.append(
                (
                    1.0,
                    {
                        "cause": "memory",
                        "rank": rank,
                        "message": f"Rank {rank} peaked at {peak / 2**30:.1f} GiB of its "
                        f"device's {total / 2**30:.1f} GiB: close to running out. Shard the "
                        "model state (--strategy zero2 or zero3), lower the per-device "
                        "batch, or use --precision bf16-mixed.",
                    },
                )
            )
    found.sort(key=lambda item: -item[0])
    return [cause for _, cause in found]


def _data_advice(data: float, step: float, reading: Reading | None) -> str:
    """What to change when each step waits `data` of its `step` seconds for its batch."""
    said = f"Each step waits {_ms(data)} of its {_ms(step)} for the next batch ({data / step:.0%})"
    if reading is None:
        return (
            f"{said}: the input pipeline is the bottleneck. Give the DataLoader more worker "
            "processes (num_workers), pin memory, or prepare the samples ahead of training."
        )
    workers = reading.num_workers
    compute = step - data
    # How long one batch takes to make: `data` where the training process makes it (0
    # workers); W workers that feed one batch a step take about W steps each. Workers keep
    # up once together they finish one batch in the `compute` of a step.
    making = data if workers == 0 else workers * step
    enough = max(workers + 1, math.ceil(making / max(compute, 1e-6)))
    advice = (
        f"{said} with num_workers={workers}: the input pipeline is the bottleneck. Pass "
        f"num_workers={enough} to engine.dataloader, so that worker processes make the "
        f"batches while the model computes ({_ms(compute)} a step)"
    )
    if reading.unpinned:
        advice += ", and pin_memory=True, so that copies to the GPU overlap compute"
    spare = reading.cores - 1  # one core trains
    if enough > spare:
        advice += (
            f". This machine has {reading.cores} CPU core(s) per training process: more "
            f"than {max(spare, 0)} worker(s) speed up reading that waits (disk, network), not "
            "decoding that computes; decode ahead of training instead (shard files of "
            "prepared samples: dtrain data write)"
        )
    return advice + "."


def _accumulate_more(grad_accumulation: int) -> str:
    """The advice on gradient accumulation for a run that uses `grad_accumulation`."""
    if grad_accumulation > 1:
        return f"raise --grad-accumulation above its {grad_accumulation}"
    return "use --grad-accumulation"


def _fewer_bytes(job: Job | None) -> str:
    """The advice to send fewer bytes per step: across machines, the flags that apply to
    `job`'s strategy, by how faithfully they keep its training (`training_of`): exact
    ones first, then a 16-bit cast, then those that change it (compression only where
    dtrain runs it)."""
    generic = "use --hierarchical across machines, or a strategy that moves fewer bytes per step"
    if job is not None and job.cp > 1:
        return (
            f"or cut each sample over fewer ranks (a lower --cp than {job.cp}, more "
            "data-parallel ranks): every block's keys and values cross the context ranks, "
            "forward and backward"
        )
    if job is not None and job.ep > 1:
        return (
            f"or split the experts over fewer ranks (a lower --ep than {job.ep}): every MoE "
            "layer sends its tokens to the experts' ranks and back, forward and backward"
        )
    if job is None or job.nnodes < 2:
        return generic
    exact, rounded, approximate = [], [], []
    if job.strategy == "ddp" and not job.hierarchical:
        exact.append("--hierarchical")
    if job.strategy in ("zero2", "zero3"):
        exact.append("--strategy hsdp (shards inside each machine, replicates across)")
    cast = training_of(job.strategy, job.grad_compression) == "rounded"
    if job.strategy in COMPRESSES_CAST and job.grad_compression == "none":
        rounded.append(f"--grad-compression {job.half}")
    elif job.strategy in COMPRESSES_POWERSGD and cast and not job.hierarchical:
        approximate.append("--grad-compression powersgd:4")  # PowerSGD refuses --hierarchical
    if job.strategy in DATA_PARALLEL:
        approximate.append("--strategy local-sgd (if a whole replica fits one device)")
    elif job.strategy == "local-sgd":
        approximate.append("a larger --sync-every")
    flags = exact + rounded + approximate
    if not flags:
        return "or use a strategy that moves fewer bytes per step"
    listed = ", ".join(flags[:-1]) + (" or " if len(flags) > 1 else "") + flags[-1]
    text = f"or send fewer bytes between the {job.nnodes} machines: {listed}"
    if rounded:
        text += f"; {rounded[0]} rounds each gradient to 16 bits (the same training within"
        text += " that rounding)"
    if approximate:
        many = len(approximate) > 1
        which = f"the last {len(approximate)} change" if many else "the last changes"
        if len(approximate) == len(flags):
            which = "these change" if many else "this changes"
        text += f"; {which} the training: check the loss"
    return text


def _straggler(
    breakdown: list[dict[str, float]], step: float
) -> tuple[float, dict[str, Any]] | None:
    """The rank whose busy time exceeds the others' by a good share of the step."""
    if len(breakdown) < 2:
        return None
    busy = [_busy(p) for p in breakdown]
    rank = max(range(len(busy)), key=busy.__getitem__)
    others = statistics.median(b for i, b in enumerate(busy) if i != rank)
    lateness = busy[rank] - others
    if lateness < SHARE * step or busy[rank] < STRAGGLER_RATIO * others:
        return None
    return (
        lateness / step,
        {
            "cause": "straggler",
            "rank": rank,
            "message": f"Rank {rank} is busy {_ms(busy[rank])} per step against {_ms(others)} "
            f"on the others, so they wait about {_ms(lateness)} for it at every step. Look "
            "at what else runs on its device or machine, its share of the data, and extra "
            "work the loop does on that rank only.",
        },
    )


def table(breakdown: list[dict[str, float]], causes: list[dict[str, Any]]) -> str:
    """The end-of-run summary: one row per rank (milliseconds per step), then the causes."""
    columns = ("data", "forward", "backward", "communication", "optimizer", "other", "step")
    heads = ("rank", "data", "fwd", "bwd", "comm", "optim", "other", "step")
    lines = [
        "dtrain: where each step's time went (ms per step, medians after warm-up)",
        " ".join(f"{h:>7}" for h in heads),
    ]
    for rank, part in enumerate(breakdown):
        cells = [f"{rank:>7}"] + [f"{part[c] * 1000:>7.1f}" for c in columns]
        lines.append(" ".join(cells))
    if causes:
        lines.append("dtrain: what to change, most important first:")
        lines += [f"  [{c['cause']}] {c['message']}" for c in causes]
    else:
        lines.append(
            "dtrain: no bottleneck stands out: compute takes most of each step on every rank."
        )
    return "\n".join(lines)
