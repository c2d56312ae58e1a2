"""What a loss read costs under DDP, and what the ways to hide it cost in its place.

dtrain reads the ranks' losses back every `--log-every` steps, before that step's update,
with one all-reduce over the data-parallel ranks (so that every rank stops together
before a non-finite loss reaches the parameters). This benchmark prices that read and
two ways to keep its promise without a blocking collective of its own, in plain
PyTorch, each against the same DDP loop with no read at all, side by side in the same
processes (`harness.interleaved`), on the 16x16 stack of `step_overhead.py`:

    read      the losses of the last `--every` steps all-reduced after the read step's
              backward, then read back (what dtrain does)
    async     the same all-reduce launched before the read step's backward and waited
              for after it, so that it overlaps the backward and DDP's own all-reduce
    carried   no collective of its own: every step's loss travels with the gradients,
              one more element in DDP's first bucket, through a Python communication
              hook
    hook      that Python hook carrying nothing: the price of leaving DDP's built-in
              (C++) all-reduce for a hook written in Python, on every bucket and step

    python benchmarks/loss_read.py --repeats 5
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import argparse
import gc
import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Loop, arguments, interleaved, launch, report
from step_overhead import make_data, plain_model
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

WAYS = ("read", "async", "carried", "hook")


@dataclass
class Carrier:
    """The state of `carrying_hook`: the loss to send with the next gradients, and the
    mean over the ranks that came back."""

    group: dist.ProcessGroup
    offer: torch.Tensor | None = None
    means: list[torch.Tensor] = field(default_factory=list)


def carrying_hook(state: Carrier, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket averaged over `state.group`; bucket 0 carries
    `state.offer` (when set) as one more element, whose mean is kept in `state.means`."""
    buffer = bucket.buffer()
    offer, size = state.offer, state.group.size()
    if offer is None or bucket.index() != 0:
        work = dist.all_reduce(buffer.div_(size), group=state.group, async_op=True)
        return work.get_future().then(lambda done: done.value()[0])
    state.offer = None
    joined = torch.cat([buffer, offer.reshape(1).to(buffer.dtype)]).div_(size)
    n = buffer.numel()

    def split(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = done.value()[0]
        state.means.append(reduced[n:])
        return reduced[:n]

    work = dist.all_reduce(joined, group=state.group, async_op=True)
    return work.get_future().then(split)


def ddp_loop(args: argparse.Namespace, data: TensorDataset, way: str | None) -> Loop:
    """The plain DDP loop, reading its losses the `way` given (None: never)."""
    model, optimizer = plain_model("ddp", args.layers)
    group = dist.group.WORLD
    carrier = Carrier(group)
    if way in ("carried", "hook"):
        model.register_comm_hook(carrier, carrying_hook)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    batch = args.global_batch_size // dist.get_world_size()
    loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
    losses: list[torch.Tensor] = []
    count = [0]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        count[0] += 1
        reading = count[0] % args.every == 0
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.detach())
        work = None
        if way == "carried":
            carrier.offer = loss.detach()
        elif way == "async" and reading:
            sums = torch.stack(losses).double()
            work = dist.all_reduce(sums, group=group, async_op=True)
        loss.backward()
        if reading and way in ("read", "async", "carried"):
            if way == "read":
                sums = torch.stack(losses).double()
                dist.all_reduce(sums, group=group)
            elif work is not None:
                work.wait()
            else:
                sums = torch.cat(carrier.means)
                carrier.means.clear()
            if not all(map(math.isfinite, sums.tolist())):
                raise FloatingPointError("a non-finite loss; the benchmark's data has none")
        if reading:
            losses.clear()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Loop(iter(loader), step)


def worker(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """(no read, the way) microseconds per step per repeat, for each way."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    data = make_data((args.warmup + args.steps + 1) * args.global_batch_size * 2)
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in args.ways}
    for _ in range(args.repeats):
        for way in args.ways:
            pair = interleaved(
                ddp_loop(args, data, None), ddp_loop(args, data, way), args.warmup, args.steps
            )
            results[way].append((pair[0] * 1e6, pair[1] * 1e6))
    gc.collect()  # no DDP object left when the group goes (a known gloo abort otherwise)
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = arguments(__doc__, batch=8, steps=300, warmup=30, repeats=5)
    parser.add_argument("--layers", type=int, default=4, help="linear layers")
    parser.add_argument("--every", type=int, default=10, help="steps between reads")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"some of {WAYS}")
    args = parser.parse_args()
    args.ways = args.ways.split(",")
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; choose from {WAYS}")
    results = launch(args.nproc, worker, args)[0]
    added = {}
    for way in args.ways:
        title = (
            f"{way}: DDP, {args.layers} layers, world size {args.nproc}, a read every "
            f"{args.every} steps, {args.repeats} repeats (peer: the same loop with no read)"
        )
        report(title, results[way], "us/step")
        added[way] = statistics.median(ours - plain for plain, ours in results[way])
    print(f"{'way':<8} {'added us/step (median of repeats)':>34}")
    for way, us in added.items():
        print(f"{way:<8} {us:>34.0f}")


if __name__ == "__main__":
    main()
