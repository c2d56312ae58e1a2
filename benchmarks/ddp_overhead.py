"""dtrain's `ddp` against a plain PyTorch DDP loop: same model, data and world size.

Both loops run in the same processes, alternating, `--repeats` times; each run trains
`--steps` steps from a fresh model and is timed from the first to the last step (after
`--warmup` untimed steps). Prints samples/s of each run and the median ratio
dtrain / plain (goal: >= 0.98, no measurable overhead), then the same per CPU-second of
rank 0 (its work per sample, all threads, whatever the machine's load did to wall time).

    python benchmarks/ddp_overhead.py --nproc 2 --repeats 7
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import alternate, arguments, launch, report, timed_with_cpu
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dtrain
from dtrain.models import build


def make_model(name: str) -> torch.nn.Module:
    """A bundled digits model, or `bare`: two tiny layers whose compute is next to nothing,
    so that the step time is the loop's own work (data, wrappers, hooks, optimizer)."""
    if name == "bare":
        return torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 4), torch.nn.ReLU(), torch.nn.Linear(4, 10)
        )
    return build(name)


def make_data(samples: int) -> TensorDataset:
    """Digit-shaped synthetic data (the digits set is too small for long timed runs)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(samples, 1, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return TensorDataset(images, labels)


Rates = tuple[float, float]
"""(samples per wall second, samples per CPU second of this rank)."""


def rates(args: argparse.Namespace, seconds: tuple[float, float]) -> Rates:
    """The rates of a run of `args.steps` global batches that took `seconds`."""
    samples = args.steps * args.global_batch_size
    return samples / seconds[0], samples / seconds[1]


def plain_run(args: argparse.Namespace, data: TensorDataset) -> Rates:
    """Rates of the loop a user writes by hand with torch DDP."""
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model(args.model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per_worker = args.global_batch_size // dist.get_world_size()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=per_worker, sampler=sampler, drop_last=True)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return rates(args, timed_with_cpu(loader, step, args.warmup, args.steps))


def dtrain_run(args: argparse.Namespace, data: TensorDataset) -> Rates:
    """Rates of the same job through dtrain's Engine (strategy ddp)."""
    engine = dtrain.init(strategy="ddp")
    model = make_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(data, batch_size=args.global_batch_size // engine.dp_size)
    batches = engine.progress(loader, epoch=0)
    seconds = timed_with_cpu(
        batches, lambda b: engine.train_step(b, F.cross_entropy), args.warmup, args.steps
    )
    batches.close()
    del model
    engine.strategy.close()
    return rates(args, seconds)


def worker(args: argparse.Namespace) -> list[tuple[Rates, Rates]]:
    """Alternate plain and dtrain runs; return (plain, dtrain) rates per repeat."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size)
    return alternate(args.repeats, lambda: plain_run(args, data), lambda: dtrain_run(args, data))


def main() -> None:
    parser = arguments(__doc__, batch=64, steps=300, warmup=20, repeats=7)
    parser.add_argument(
        "--model",
        default="cnn",
        help="A bundled digits model, or `bare` (almost no compute: the loops' own cost).",
    )
    args = parser.parse_args()
    pairs = launch(args.nproc, worker, args)[0]
    title = (
        f"model {args.model}, world size {args.nproc}, global batch {args.global_batch_size}, "
        f"{args.steps} steps per run, {args.repeats} repeats (peer: plain PyTorch DDP)"
    )
    report(title, [(peer[0], ours[0]) for peer, ours in pairs])
    report(title, [(peer[1], ours[1]) for peer, ours in pairs], "samples/CPU-s")


if __name__ == "__main__":
    main()
