"""dtrain's own host work per step, strategy by strategy, against the plain-PyTorch loop.

The model is a stack of 16x16 linear layers and the global batch 8, so the compute is
next to nothing and a step's time is the loops' own work: data, wrappers, hooks,
collectives, optimizer, and what dtrain adds (observers, loss checks, progress bar,
timing). Each strategy runs against its peer written by hand, side by side in the same
processes: both warm up, then take turns, 10 windows each (`harness.interleaved`); a
loop's time per step is the median of its windows, so a burst of another job's work
that slows a window is left out and a drift of the machine's pace hits both alike.
Microseconds per step of each and the median ratio dtrain / plain over the repeats, each
with fresh loops (goal: <= 1.05).

    single   one process, a plain loop
    towers   two towers in one process, against the plain loop of one
    ddp      DistributedDataParallel(model)
    loop     ddp through a loop written by hand (engine.backward, optimizer.step())
             against the same loop with DDP
    zero1    DDP + ZeroRedundancyOptimizer
    zero2    fully_shard per layer and the root, reshard_after_forward=False
    zero3    fully_shard per layer and the root
    tensor   parallelize_module, the layers split column- then row-wise in pairs
    pipeline PipelineStage per rank (the layers cut in equal runs) and Schedule1F1B,
             4 micro-batches
    ps       synchronous parameter server (one server process besides the workers),
             against DDP at the same number of workers: the closest plain loop, not the
             same algorithm (each step pushes to and pulls from the server), so its ratio
             is the architecture's cost as much as dtrain's; each repeat starts its own
             processes (the servers are processes of their own)

    python benchmarks/step_overhead.py --repeats 7
    python benchmarks/step_overhead.py --strategies ddp,zero3 --steps 500
    python benchmarks/step_overhead.py --strategies single,ddp --layers 100   # 200 tensors:
                                                      # where per-parameter costs show
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import (
    Loop,
    alternate,
    arguments,
    interleaved,
    launch,
    per_step,
    pipeline_step,
    report,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dtrain

WIDTH = 16
LAYERS = 4
SINGLE = ("single", "towers")
MULTI = ("ddp", "loop", "zero1", "zero2", "zero3", "tensor", "pipeline")
OWN_PROCESSES = ("ps",)
STRATEGIES = (*SINGLE, *MULTI, *OWN_PROCESSES)
MICROBATCHES = 4


class Stack(nn.Module):
    """`depth` linear layers of WIDTH x WIDTH with ReLU between them."""

    def __init__(self, depth: int = LAYERS) -> None:
        super().__init__()
        self.depth = depth
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(WIDTH, WIDTH)] + ([nn.ReLU()] if i < depth - 1 else [])
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers in forward order, each a place a stage may begin."""
        return [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """Pairs of layers, the first split by columns, the second by rows."""
        styles = ("colwise", "rowwise")
        return {f"layers.{2 * i}": styles[i % 2] for i in range(self.depth)}


def make_data(samples: int) -> TensorDataset:
    """Random inputs and class labels."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, WIDTH, generator=generator)
    return TensorDataset(inputs, torch.randint(0, WIDTH, (samples,), generator=generator))


def plain_model(strategy: str, depth: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (`depth` layers) and optimizer a user sets up by hand for `strategy`."""
    torch.manual_seed(0)
    model = Stack(depth)
    if strategy in SINGLE:
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if strategy in ("ddp", "loop", "zero1"):
        model = DistributedDataParallel(model)
        if strategy == "zero1":
            optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01, momentum=0.9
            )
            return model, optimizer
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if strategy == "tensor":
        plan = {
            name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
            for name, style in model.tensor_parallel_plan(dist.get_world_size()).items()
        }
        parallelize_module(model, mesh, plan)
    else:
        reshard = strategy == "zero3"
        for layer in model.layers:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def per_rank_batch(args: argparse.Namespace, strategy: str) -> int:
    """Every tensor-parallel rank sees the whole batch; data-parallel ones a share."""
    if strategy in (*SINGLE, "tensor", "pipeline"):
        return args.global_batch_size
    return args.global_batch_size // dist.get_world_size()


def plain_loop(args: argparse.Namespace, strategy: str, data: TensorDataset) -> Loop:
    """The loop written by hand."""
    if strategy == "pipeline":
        return plain_pipeline(args, data)
    model, optimizer = plain_model(strategy, args.layers)
    batch_size = per_rank_batch(args, strategy)
    if strategy in (*SINGLE, "tensor"):
        loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)
    else:
        sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Loop(iter(loader), step)


def plain_pipeline(args: argparse.Namespace, data: TensorDataset) -> Loop:
    """A pipeline written by hand with torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    rank, stages = dist.get_rank(), dist.get_world_size()
    layers = list(Stack(args.layers).layers)
    cut = [round(i * len(layers) / stages) for i in range(stages + 1)]
    module = nn.Sequential(*layers[cut[rank] : cut[rank + 1]])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=F.cross_entropy)
    loader = DataLoader(data, batch_size=args.global_batch_size, shuffle=True, drop_last=True)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        pipeline_step(schedule, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Loop(iter(loader), step)


def dtrain_loop(
    args: argparse.Namespace, strategy: str, data: TensorDataset
) -> tuple[Loop, Callable[[], None]]:
    """The same job through dtrain (its progress bar included), and what ends it."""
    options: dict[str, Any] = {"towers": 2} if strategy == "towers" else {}
    if strategy == "pipeline":
        options["microbatches"] = MICROBATCHES
    name = "ddp" if strategy == "loop" else strategy
    engine = dtrain.init(strategy=name, cpu=True, **options)
    model = Stack(args.layers)
    model, optimizer = engine.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    )
    loader = engine.dataloader(data, batch_size=args.global_batch_size // engine.dp_size)
    batches = engine.progress(loader, epoch=0)
    step: Callable[[Any], Any]
    if strategy == "loop":

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            x, y = engine.to_device(batch)
            engine.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            engine.train_step(batch, F.cross_entropy)

    def end() -> None:
        batches.close()
        engine.strategy.close()

    return Loop(batches, step), end


def side_by_side(
    args: argparse.Namespace, strategy: str, data: TensorDataset
) -> tuple[float, float]:
    """(plain, dtrain) microseconds per step of one repeat: fresh loops, interleaved."""
    peer = plain_loop(args, strategy, data)
    ours, end = dtrain_loop(args, strategy, data)
    try:
        plain, dtrain_seconds = interleaved(peer, ours, args.warmup, args.steps, args.windows)
    finally:
        end()
    return plain * 1e6, dtrain_seconds * 1e6


def worker(args: argparse.Namespace, strategies: list[str]) -> dict[str, list[tuple[float, float]]]:
    """(plain, dtrain) microseconds per step per repeat, for each strategy."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size)
    return {
        strategy: [side_by_side(args, strategy, data) for _ in range(args.repeats)]
        for strategy in strategies
    }


def ps_side(args: argparse.Namespace) -> float:
    """Microseconds per step of a ps worker (under `dtrain.launch`)."""
    torch.set_num_threads(args.threads)
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size)
    ours, end = dtrain_loop(args, "ps", data)
    try:
        # The default group holds the servers too: no barrier (the synchronous server keeps
        # the workers in step).
        return per_step(ours.batches, ours.step, args.warmup, args.steps, settle=False) * 1e6
    finally:
        end()


def ps_peer(args: argparse.Namespace) -> float:
    """Microseconds per step of the plain DDP loop on as many processes."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size)
    peer = plain_loop(args, "ddp", data)
    return per_step(peer.batches, peer.step, args.warmup, args.steps) * 1e6


def ps_pairs(args: argparse.Namespace) -> list[tuple[float, float]]:
    """(DDP, ps) microseconds per step per repeat, each run in processes of its own."""
    return alternate(
        args.repeats,
        lambda: launch(args.nproc, ps_peer, args)[0],
        lambda: statistics.median(
            dtrain.launch(ps_side, args, nproc=args.nproc, strategy="ps", servers=1)
        ),
    )


def main() -> None:
    parser = arguments(__doc__, batch=8, steps=300, warmup=30, repeats=5)
    parser.add_argument(
        "--layers", type=int, default=LAYERS, help="linear layers (2 parameter tensors each)"
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"some of {STRATEGIES}")
    parser.add_argument(
        "--windows", type=int, default=10, help="timed windows per loop and repeat (turns)"
    )
    args = parser.parse_args()
    chosen = args.strategies.split(",")
    unknown = set(chosen) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    results: dict[str, list[tuple[float, float]]] = {}
    alone = [s for s in chosen if s in SINGLE]
    if alone:
        results.update(launch(1, worker, args, alone)[0])
    multi = [s for s in chosen if s in MULTI]
    if multi:
        results.update(launch(args.nproc, worker, args, multi)[0])
    if "ps" in chosen:
        results["ps"] = ps_pairs(args)
    ratios = {}
    for strategy in chosen:
        world = 1 if strategy in SINGLE else args.nproc
        title = (
            f"{strategy}: {args.layers} layers of {WIDTH}x{WIDTH}, world size {world}, "
            f"global batch {args.global_batch_size}, {args.steps} steps per run, "
            f"{args.repeats} repeats (peer: plain PyTorch; lower is better, goal <= 1.05)"
        )
        ratios[strategy] = report(title, results[strategy], "us/step")
    print(f"{'strategy':<9} {'plain us':>9} {'dtrain us':>10} {'added us':>9} {'ratio':>6}")
    for strategy in chosen:
        pairs = results[strategy]
        plain = sorted(p for p, _ in pairs)[len(pairs) // 2]
        ours = sorted(o for _, o in pairs)[len(pairs) // 2]
        print(
            f"{strategy:<9} {plain:>9.0f} {ours:>10.0f} {ours - plain:>9.0f} "
            f"{ratios[strategy]:>6.3f}"
        )


if __name__ == "__main__":
    main()
