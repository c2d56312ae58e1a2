"""The pipeline bubble and activation memory, measured inside dtrain's pipeline.

For each schedule (GPipe, 1F1B) and micro-batch count M, every stage times its own
compute (each micro-batch's forward and backward: dtrain's TimedStage) within the
schedule's step; the idle
fraction 1 - compute / step is the bubble, printed beside GPipe's (P-1)/(M+P-1). The
bytes autograd holds for backward (activations, not weights) are tracked as they are
saved and freed; their peak per stage shows 1F1B holding at most P - s micro-batches
where GPipe holds all M.

    python benchmarks/pipeline_bubble.py --nproc 2 --size medium --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from harness import arguments, launch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.data import TensorDataset

import dtrain
from dtrain.models import build
from dtrain.models.gpt import lm_loss


class Meter:
    """The activation bytes this rank's stage holds for backward."""

    live: dict[int, list[int]] = {}  # storage address -> [references, bytes]
    held = 0
    peak = 0
    weights: set[int] = set()

    @classmethod
    def reset(cls, model: torch.nn.Module) -> None:
        cls.live, cls.held, cls.peak = {}, 0, 0
        cls.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}


class Saved:
    """A tensor autograd keeps for backward; counted while it is alive."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.key = tensor.untyped_storage().data_ptr()
        entry = Meter.live.setdefault(self.key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            Meter.held += entry[1]
            Meter.peak = max(Meter.peak, Meter.held)
        entry[0] += 1

    def __del__(self) -> None:
        entry = Meter.live[self.key]
        entry[0] -= 1
        if entry[0] == 0:
            Meter.held -= entry[1]
            del Meter.live[self.key]


def pack(tensor: torch.Tensor) -> Any:
    if tensor.untyped_storage().data_ptr() in Meter.weights:
        return tensor
    return Saved(tensor)


def unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, Saved) else saved


def measure(args: argparse.Namespace, schedule: str, m: int, data: TensorDataset) -> dict:
    """Median idle fraction and peak activation MiB of this rank's stage."""
    engine = dtrain.init(strategy="pipeline", schedule=schedule, microbatches=m)
    model = build("gpt", args.size)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    pipeline = engine.strategy.pipeline
    run = pipeline.schedule.step
    idle, peaks = [], []

    def timed_step(*a: Any, **kw: Any) -> Any:
        # The step is the time from all stages starting to all finishing: the last stage
        # is done early and idles while the first finishes its backwards.
        Meter.reset(engine.module)
        dist.barrier(group=pipeline.group)
        start = time.perf_counter()
        result = run(*a, **kw)
        dist.barrier(group=pipeline.group)
        wall = time.perf_counter() - start
        busy = sum(stage.take_seconds() for stage in pipeline.stages)
        idle.append(1 - busy / wall)
        peaks.append(Meter.peak)
        return result

    pipeline.schedule.step = timed_step
    for module in pipeline.modules.values():  # count what each forward saves for backward
        hooks = saved_tensors_hooks(pack, unpack)
        module.register_forward_pre_hook(lambda *_, h=hooks: h.__enter__())
        module.register_forward_hook(lambda *_, h=hooks: h.__exit__(None, None, None))
    loader = engine.dataloader(data, batch_size=args.global_batch_size)
    for i, batch in enumerate(engine.progress(loader, epoch=0)):
        if i == args.warmup + args.steps:
            break
        engine.train_step(batch, lm_loss)
    del model, optimizer
    engine.strategy.close()
    return {
        "idle": statistics.median(idle[args.warmup :]),
        "peak_mib": max(peaks[args.warmup :]) / 2**20,
    }


def worker(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    context = build("gpt", args.size).config.context
    g = torch.Generator().manual_seed(0)
    samples = (args.warmup + args.steps + 1) * args.global_batch_size
    tokens = torch.randint(0, 256, (samples, context + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.microbatches:
            if schedule == "1f1b" and m < args.nproc:
                continue  # 1F1B needs at least one micro-batch per stage
            rows.append({"schedule": schedule, "m": m, **measure(args, schedule, m, data)})
    return rows


def main() -> None:
    parser = arguments(__doc__, batch=16, steps=6, warmup=2, repeats=None)  # P = --nproc
    parser.add_argument("--size", default="medium")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    by_rank = launch(args.nproc, worker, args)
    p = args.nproc
    print(
        f"GPT {args.size}, P = {p} stages, global batch {args.global_batch_size}, median of "
        f"{args.steps} steps\n"
    )
    stages = " ".join(f"{'stage ' + str(s):>8}" for s in range(p))
    print(f"{'schedule':>8} {'M':>3} {'theory':>7} {'mean':>6} {stages}   peak activations MiB")
    for i, row in enumerate(by_rank[0]):
        m = row["m"]
        idle = [rank[i]["idle"] for rank in by_rank]
        peaks = " ".join(f"{rank[i]['peak_mib']:7.1f}" for rank in by_rank)
        per_stage = " ".join(f"{x:>8.1%}" for x in idle)
        theory = (p - 1) / (m + p - 1)
        print(
            f"{row['schedule']:>8} {m:>3} {theory:>7.1%} {statistics.mean(idle):>6.1%} "
            f"{per_stage}   {peaks}"
        )


if __name__ == "__main__":
    main()
