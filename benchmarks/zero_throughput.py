"""zero1, zero2 and zero3 through dtrain against the same sharding written by hand in
plain PyTorch (DDP + ZeroRedundancyOptimizer; FSDP2 `fully_shard` on every block, then
the root), on a GPT with AdamW: samples/s of each, alternating, and the median ratio
dtrain / plain (goal: >= 0.98). `--stages ddp,...` adds plain DDP against dtrain's ddp;
`--gpu` runs on the GPUs over NCCL (one process per GPU), batches moved to the device each
step in both loops.

    python benchmarks/zero_throughput.py --nproc 2 --size small --repeats 5
    python benchmarks/zero_throughput.py --gpu --nproc 1 --size medium --stages ddp,zero3
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from harness import alternate, arguments, launch, report, timed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dtrain
from dtrain.models import build
from dtrain.models.gpt import lm_loss

STAGES = ("ddp", "zero1", "zero2", "zero3")


def make_data(samples: int, context: int) -> TensorDataset:
    """Random byte sequences (inputs, targets shifted by one)."""
    tokens = torch.randint(
        0, 256, (samples, context + 1), generator=torch.Generator().manual_seed(0)
    )
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plain_model(stage: str, size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer a user would set up by hand for `stage` (or plain ddp)."""
    torch.manual_seed(0)
    model = build("gpt", size)
    if stage in ("ddp", "zero1"):
        model.to(device())
    if stage == "ddp":
        wrapped = DistributedDataParallel(model)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    if stage == "zero1":
        wrapped = DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
        return wrapped, optimizer
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    reshard = stage == "zero3"
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def plain_run(args: argparse.Namespace, stage: str, data: TensorDataset) -> float:
    """samples/s of the hand-written loop."""
    model, optimizer = plain_model(stage, args.size)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(
        data,
        batch_size=args.global_batch_size // dist.get_world_size(),
        sampler=sampler,
        drop_last=True,
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = (t.to(device(), non_blocking=True) for t in batch)
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return args.steps * args.global_batch_size / timed(loader, step, args.warmup, args.steps)


def dtrain_run(args: argparse.Namespace, stage: str, data: TensorDataset, **options: Any) -> float:
    """samples/s of the same job through dtrain (`--strategy stage`, more `options`)."""
    engine = dtrain.init(strategy=stage, cpu=device().type == "cpu", **options)
    model = build("gpt", args.size)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = engine.dataloader(data, batch_size=args.global_batch_size // engine.dp_size)
    batches = engine.progress(loader, epoch=0)
    seconds = timed(batches, lambda b: engine.train_step(b, lm_loss), args.warmup, args.steps)
    batches.close()
    del model
    engine.strategy.close()
    return args.steps * args.global_batch_size / seconds


def worker(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """(plain, dtrain) samples/s per repeat, for each stage."""
    torch.set_num_threads(args.threads)
    if args.gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.gpu else "gloo")
    context = build("gpt", args.size).config.context
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size, context)
    return {
        stage: alternate(
            args.repeats,
            lambda s=stage: plain_run(args, s, data),
            lambda s=stage: dtrain_run(args, s, data),
        )
        for stage in args.stages.split(",")
    }


def main() -> None:
    parser = arguments(__doc__, batch=16, steps=30, warmup=5, repeats=5)
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", default="zero1,zero2,zero3", help=f"some of {STAGES}")
    parser.add_argument("--gpu", action="store_true", help="one process per GPU, over NCCL")
    args = parser.parse_args()
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        parser.error(f"unknown stage(s) {sorted(unknown)}; choose from {STAGES}")
    for stage, pairs in launch(args.nproc, worker, args)[0].items():
        report(
            f"{stage}: GPT {args.size}, {'GPU' if args.gpu else 'CPU'}, world size "
            f"{args.nproc}, global batch {args.global_batch_size}, {args.steps} steps per run, "
            f"{args.repeats} repeats (peer: plain PyTorch)",
            pairs,
        )


if __name__ == "__main__":
    main()
