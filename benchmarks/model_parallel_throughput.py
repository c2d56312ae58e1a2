"""samples/s of pipeline (GPipe, 1F1B) and tensor parallelism through dtrain against the
same GPT under plain PyTorch DDP, in the same processes, alternating; the median ratio
mode / ddp of each.

Model parallelism pays for fitting a model that data parallelism cannot hold: a pipeline
idles for its bubble and sends activations, tensor parallelism all-reduces activations
twice per block forward and twice backward. Where the model fits one device, ddp is the
figure to beat.

    python benchmarks/model_parallel_throughput.py --nproc 2 --size small --repeats 3
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from harness import alternate, arguments, launch, report
from zero_throughput import dtrain_run, make_data, plain_run

from dtrain.models import build


def modes(args: argparse.Namespace) -> dict[str, tuple[str, dict]]:
    """Label -> (strategy, options) of each mode measured."""
    m = args.microbatches
    return {
        f"pipeline gpipe M={m}": ("pipeline", {"schedule": "gpipe", "microbatches": m}),
        f"pipeline 1f1b M={m}": ("pipeline", {"schedule": "1f1b", "microbatches": m}),
        "tensor": ("tensor", {}),
    }


def worker(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """(ddp, mode) samples/s per repeat, for each mode."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    context = build("gpt", args.size).config.context
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size, context)
    return {
        label: alternate(
            args.repeats,
            lambda: plain_run(args, "ddp", data),
            lambda s=strategy, o=options: dtrain_run(args, s, data, **o),
        )
        for label, (strategy, options) in modes(args).items()
    }


def main() -> None:
    parser = arguments(__doc__, batch=16, steps=20, warmup=3, repeats=3)
    parser.add_argument("--size", default="small")
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    for label, pairs in launch(args.nproc, worker, args)[0].items():
        report(
            f"{label}: GPT {args.size}, {args.nproc} processes, global batch "
            f"{args.global_batch_size}, {args.steps} steps per run, {args.repeats} repeats "
            "(peer: plain PyTorch DDP)",
            pairs,
        )


if __name__ == "__main__":
    main()
