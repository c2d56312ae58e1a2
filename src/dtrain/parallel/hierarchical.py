"""Hierarchical all-reduce for ddp (`--hierarchical`): average the gradients inside each
machine first, across machines second, and back inside each machine last.

Bandwidth falls at every step outward (GPU-GPU, then PCIe, then the network), so the
fewer bytes cross machines the better. A flat ring over n ranks on h machines sends
2(n-1)/n x S bytes per rank, and the ring crosses between machines on several of its
edges; here only one leader per machine (its local rank 0) talks across machines, with
2(h-1)/h x S bytes, after the machine's ranks reduced their gradients to it, and it
broadcasts the result back inside. A DDP communication hook: DDP still buckets the
gradients and calls the hook as each bucket is ready.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.errors import ConfigError


@dataclass(frozen=True)
class HostGroups:
    """The process groups of one rank's machine and of the machines' leaders."""

    inside: dist.ProcessGroup
    """Every rank of this rank's machine."""
    leader: int
    """The global rank of this machine's leader (its first rank)."""
    across: dist.ProcessGroup | None
    """The leaders of every machine; None on ranks that do not lead."""
    world: int
    """Ranks in all (the gradients are averaged over them)."""
    compress: torch.dtype | None = None
    """The dtype the leaders all-reduce in across machines (--grad-compression fp16 or
    bf16); None: the gradients' own."""


def host_groups(world: int, per_host: int, compress: torch.dtype | None = None) -> HostGroups:
    """The groups for `world` ranks laid out `per_host` to a machine (ranks of one machine
    are consecutive, as the launcher numbers them), the leaders all-reducing in `compress`
    (None: uncompressed). Every rank must call it (new_group)."""
    if world % per_host:
        raise ConfigError(
            f"--hierarchical groups the {world} processes by machine, {per_host} to a machine "
            "(--nproc), which does not divide them; run the same --nproc on every machine."
        )
    rank = dist.get_rank()
    hosts = [list(range(start, start + per_host)) for start in range(0, world, per_host)]
    inside = None
    for members in hosts:
        group = dist.new_group(members)
        if rank in members:
            inside = group
    leaders = [members[0] for members in hosts]
    across = dist.new_group(leaders)
    assert inside is not None
    mine = hosts[rank // per_host]
    return HostGroups(inside, mine[0], across if rank in leaders else None, world, compress)


def hierarchical_hook(
    state: HostGroups, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over every rank, reduced
    inside the machine to its leader, all-reduced across the leaders, broadcast back.

    Every collective is issued here, in the hook, which DDP calls in bucket order on every
    rank: the ranks of a group must issue its collectives in one order. Issued from a
    callback instead, a bucket's broadcast and the next bucket's reduce would come in one
    order on the leader (which first waits for the all-reduce across machines) and in the
    other on the rest of its machine, and the machine would deadlock on a model of several
    buckets. The broadcast back is left running while backward goes on. With
    `state.compress` the leaders send the machines' sums in that dtype (the slow links carry
    half the bytes); inside a machine the gradients go at full precision.
    """
    tensor = bucket.buffer().div_(state.world)
    reduced = dist.reduce(tensor, dst=state.leader, group=state.inside, async_op=True)
    assert reduced is not None
    reduced.wait()
    if state.across is not None:
        sent = tensor.to(state.compress or tensor.dtype)  # `tensor` itself if uncompressed
        dist.all_reduce(sent, group=state.across)
        tensor.copy_(sent)
    back = dist.broadcast(tensor, src=state.leader, group=state.inside, async_op=True)
    assert back is not None
    return back.get_future().then(lambda _: tensor)
