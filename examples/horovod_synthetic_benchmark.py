"""Training throughput on synthetic data, written as Horovod users write it: a stack of
linear layers trained on random inputs with `hvd.DistributedOptimizer`, timed per
iteration after a warm-up. A few short iterations by default; raise --num-iters and
--hidden for a real measurement.

    horovodrun -np 2 -H localhost:2 python examples/horovod_synthetic_benchmark.py
    horovodrun -np 2 python examples/horovod_synthetic_benchmark.py --fp16-allreduce
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Horovod synthetic benchmark")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--hidden", type=int, default=512, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send fp16 gradients")
    return parser.parse_args(argv)


def build_model(hidden: int, layers: int) -> nn.Module:
    """`layers` hidden linear layers of width `hidden` with ReLU, 10 classes out."""
    blocks: list[nn.Module] = [nn.Linear(hidden, hidden) for _ in range(layers)]
    stack = [m for block in blocks for m in (block, nn.ReLU())]
    return nn.Sequential(*stack, nn.Linear(hidden, 10))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)

    model = build_model(args.hidden, args.layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, args.hidden, device=device)
    target = torch.randint(0, 10, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.layers} x {args.hidden} MLP, batch size {args.batch_size} per process")
    log(f"Processes: {hvd.size()} on {device.type}")
    for _ in range(args.num_warmup_batches):
        benchmark_step()

    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            benchmark_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start)
        log(f"Iter #{i}: {rate:.1f} samples/sec per process")
        rates.append(rate)

    mean = statistics.fmean(rates)
    spread = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    log(f"Samples/sec per process: {mean:.1f} +-{spread:.1f}")
    log(f"Total samples/sec on {hvd.size()} process(es): {hvd.size() * mean:.1f} +-{spread:.1f}")


if __name__ == "__main__":
    main()
