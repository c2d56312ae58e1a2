"""samples/s of pipeline (GPipe, 1F1B) and tensor parallelism through dtrain against the
same GPT under plain PyTorch DDP, and of dtrain's 1F1B against 1F1B written by hand on
torch.distributed.pipelining; in the same processes, alternating; median ratios.

Model parallelism pays for fitting a model that data parallelism cannot hold: a pipeline
idles for its bubble and sends activations, tensor parallelism all-reduces activations
twice per block forward and twice backward. Where the model fits one device, ddp is the
figure to beat.

    python benchmarks/model_parallel_throughput.py --nproc 2 --size small --repeats 3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from harness import alternate, arguments, launch, pipeline_step, report, timed
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, TensorDataset
from zero_throughput import dtrain_run, make_data, plain_run

from dtrain.models import build
from dtrain.models.gpt import lm_loss
from dtrain.parallel.split import layers_of, split_layers


def plain_pipeline_run(args: argparse.Namespace, data: TensorDataset) -> float:
    """samples/s of 1F1B written by hand on torch.distributed.pipelining (the same cut)."""
    torch.manual_seed(0)
    model = build("gpt", args.size)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = split_layers(layers_of(model), world, None)[rank]
    stage_module = nn.Sequential(*(layer for _, layer in mine))
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=args.global_batch_size, shuffle=True, drop_last=True)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        pipeline_step(schedule, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return args.steps * args.global_batch_size / timed(loader, step, args.warmup, args.steps)


def runs(args: argparse.Namespace, data: TensorDataset) -> dict[str, tuple[Callable, Callable]]:
    """Label -> (peer, dtrain) runs of each comparison."""
    m = args.microbatches
    ddp = partial(plain_run, args, "ddp", data)
    ours = partial(dtrain_run, args, data=data)
    return {
        f"pipeline gpipe M={m} / ddp": (
            ddp,
            partial(ours, "pipeline", schedule="gpipe", microbatches=m),
        ),
        f"pipeline 1f1b M={m} / ddp": (
            ddp,
            partial(ours, "pipeline", schedule="1f1b", microbatches=m),
        ),
        "tensor / ddp": (ddp, partial(ours, "tensor")),
        f"pipeline 1f1b M={m} / plain torch pipelining": (
            partial(plain_pipeline_run, args, data),
            partial(ours, "pipeline", schedule="1f1b", microbatches=m),
        ),
    }


def worker(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """(peer, dtrain) samples/s per repeat, for each comparison."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    context = build("gpt", args.size).config.context
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size, context)
    return {
        label: alternate(args.repeats, peer, ours)
        for label, (peer, ours) in runs(args, data).items()
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
            "(peer: plain PyTorch)",
            pairs,
        )


if __name__ == "__main__":
    main()
