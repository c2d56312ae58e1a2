"""dtrain's `--compile` against plain PyTorch compiled by hand: GPT, same data and world size.

Four loops train the bundled GPT in the same processes: plain PyTorch eager (torch DDP at
`--nproc` > 1, a plain loop at 1), plain PyTorch compiled as torchtitan does it (each
transformer block compiled in place with ``block.compile()`` before the model is wrapped
in DDP), dtrain eager (`ddp`, or `single` at `--nproc 1`) and dtrain with ``compile=True``.
Each loop is built once; its first `--first` steps, which compile, are timed one by one.
Then `--repeats` rounds each run `--steps` steps of every loop (after `--warmup` untimed
ones), plain and dtrain alternating which goes first. Prints samples/s of each, the
median ratio dtrain-compiled / plain-compiled (goal: >= 0.98) and dtrain-eager /
plain-eager, the same per CPU-second of rank 0, and each side's compile speedup
(compiled / eager, per round).

Inductor caches what it compiled on disk; each invocation uses a fresh cache directory
(unless TORCHINDUCTOR_CACHE_DIR is set), so the first compiled loop built (plain) compiles
cold. The second (dtrain) compiles blocks of the same class, whose graph Dynamo already
holds and reuses, so its first steps show no compilation.

    python benchmarks/compile_speed.py --nproc 2
    python benchmarks/compile_speed.py --nproc 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from harness import alternate, arguments, launch, report, timed_with_cpu
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dtrain
from dtrain.models import build
from dtrain.models.gpt import lm_loss

Batch = tuple[torch.Tensor, torch.Tensor]

Rates = tuple[float, float]
"""(samples per wall second, samples per CPU second of this rank)."""


@dataclass
class Loop:
    """One of the four training loops, built once and run for every round."""

    step: Callable[[Batch], Any]
    batches: Callable[[int], Iterator[Batch]]  # the batches of a round (an epoch)
    model: torch.nn.Module  # the user's module (to list what got compiled)
    close: Callable[[], None] = lambda: None
    first: list[float] = field(default_factory=list)  # seconds of the first steps


def make_data(args: argparse.Namespace) -> TensorDataset:
    """Random byte tokens: inputs and the next-token targets, GPT-context long."""
    context = build("gpt", args.size).config.context
    generator = torch.Generator().manual_seed(0)
    samples = (max(args.warmup + args.steps, args.first) + 1) * args.global_batch_size
    tokens = torch.randint(0, 256, (samples, context + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def plain_loop(args: argparse.Namespace, data: TensorDataset, compiled: bool) -> Loop:
    """The loop a user writes by hand: blocks compiled in place (torchtitan's way) when
    `compiled`, then torch DDP when there are several processes."""
    torch.manual_seed(0)
    user = build("gpt", args.size)
    if compiled:
        for block in user.blocks:
            block.compile()
    model = DistributedDataParallel(user) if dist.get_world_size() > 1 else user
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_worker = args.global_batch_size // dist.get_world_size()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=per_worker, sampler=sampler, drop_last=True)

    def step(batch: Batch) -> None:
        x, y = batch
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def batches(epoch: int) -> Iterator[Batch]:
        sampler.set_epoch(epoch)
        return iter(loader)

    return Loop(step, batches, user)


def dtrain_loop(args: argparse.Namespace, data: TensorDataset, compiled: bool) -> Loop:
    """The same job through dtrain's Engine, with ``compile=compiled``."""
    torch.manual_seed(0)
    strategy = "ddp" if dist.get_world_size() > 1 else "single"
    engine = dtrain.init(strategy=strategy, compile=compiled)
    model = build("gpt", args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.setup(model, optimizer)
    loader = engine.dataloader(data, batch_size=args.global_batch_size // engine.dp_size)
    return Loop(
        lambda batch: engine.train_step(batch, lm_loss),
        lambda epoch: engine.progress(loader, epoch=epoch),
        engine.strategy.unwrap(),
        engine.strategy.close,
    )


def close(batches: Iterator[Batch]) -> None:
    """End a round's batches (dtrain's progress bar is a generator to close)."""
    if hasattr(batches, "close"):
        batches.close()


def first_steps(loop: Loop, steps: int) -> None:
    """Time the loop's first `steps` steps one by one (all ranks): they compile."""
    batches = loop.batches(0)
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        loop.step(next(batches))
        dist.barrier()
        loop.first.append(time.perf_counter() - start)
    close(batches)


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s submodules compiled in place (``nn.Module.compile``)."""
    return [
        name or "(model)"
        for name, module in model.named_modules()
        if getattr(module, "_compiled_call_impl", None) is not None
    ]


def timed_round(args: argparse.Namespace, loop: Loop, epoch: int) -> Rates:
    """Rates of `args.steps` steps of `loop` on the batches of `epoch`."""
    batches = loop.batches(epoch)
    seconds = timed_with_cpu(batches, loop.step, args.warmup, args.steps)
    close(batches)
    samples = args.steps * args.global_batch_size
    return samples / seconds[0], samples / seconds[1]


NAMES = ("plain eager", "plain compiled", "dtrain eager", "dtrain compiled")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Build the four loops (timing their first steps), then alternate plain and dtrain."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    data = make_data(args)
    loops = [
        plain_loop(args, data, False),
        plain_loop(args, data, True),
        dtrain_loop(args, data, False),
        dtrain_loop(args, data, True),
    ]
    for loop in loops:
        first_steps(loop, args.first)
    pe, pc, de, dc = loops
    epochs = iter(range(1, 2 * args.repeats + 1))  # each pair of runs a fresh epoch

    def pair(eager: Loop, compiled: Loop) -> tuple[Rates, Rates]:
        epoch = next(epochs)
        return timed_round(args, eager, epoch), timed_round(args, compiled, epoch)

    pairs = alternate(args.repeats, lambda: pair(pe, pc), lambda: pair(de, dc))
    for loop in loops:
        loop.close()
    return {
        "pairs": pairs,
        "first": [loop.first for loop in loops],
        "compiled": [compiled_modules(loop.model) for loop in loops],
    }


def speedups(rounds: list[tuple[float, float]], side: str) -> None:
    """Print `side`'s median eager and compiled samples/s and its compile speedup."""
    ratios = [compiled / eager for eager, compiled in rounds]
    print(
        f"{side:>7}: eager {statistics.median(e for e, _ in rounds):,.1f} samples/s, compiled "
        f"{statistics.median(c for _, c in rounds):,.1f} samples/s, compile speedup "
        f"{statistics.median(ratios):.3f}x (spread {min(ratios):.3f} - {max(ratios):.3f})"
    )


def main() -> None:
    parser = arguments(__doc__, batch=16, steps=50, warmup=3, repeats=9)
    parser.add_argument("--size", default="small", help="the bundled GPT's size")
    parser.add_argument(
        "--first", type=int, default=3, help="steps timed one by one after building (compile)"
    )
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    result = launch(args.nproc, worker, args)[0]
    # Per round: ((plain eager, plain compiled), (dtrain eager, dtrain compiled)) rates.
    pairs = result["pairs"]
    setting = (
        f"GPT {args.size}, world size {args.nproc}, global batch {args.global_batch_size}, "
        f"{args.steps} steps per run, {args.repeats} repeats"
    )
    print("First steps (seconds, rank 0; compilation happens in the first):")
    for name, seconds, compiled in zip(NAMES, result["first"], result["compiled"], strict=True):
        where = f"  compiled: {', '.join(compiled)}" if compiled else ""
        print(f"{name:>16}: {' '.join(f'{s:.2f}' for s in seconds)}{where}")
    print()
    peer = "plain PyTorch DDP" if args.nproc > 1 else "a plain loop"
    for unit, i in (("samples/s", 0), ("samples/CPU-s", 1)):
        report(
            f"{setting}, compiled (peer: {peer}, blocks compiled in place), {unit}",
            [(plain[1][i], ours[1][i]) for plain, ours in pairs],
            unit,
        )
        report(
            f"{setting}, eager (peer: {peer}), {unit}",
            [(plain[0][i], ours[0][i]) for plain, ours in pairs],
            unit,
        )
    print(f"Compile speedup, compiled / eager samples/s per round ({setting}):")
    speedups([(plain[0][0], plain[1][0]) for plain, _ in pairs], "plain")
    speedups([(ours[0][0], ours[1][0]) for _, ours in pairs], "dtrain")


if __name__ == "__main__":
    main()
