"""Partition the parameters over the servers by bytes, in contiguous buckets.

A worker keeps its parameters back to back in one flat buffer, in the optimizer's order
(see storage.py). That buffer is cut into *buckets* of equal size (at most ~4 MiB,
smaller for small models so that K servers still get about 16 each), and the buckets are
dealt largest first to the least loaded server (LPT scheduling, as BytePS and MXNet's
KVStore deal their chunks): the imbalance is at most one bucket, i.e. max/mean <= 1 + 1/16
when every server gets 16.

A bucket is the unit of every message: a worker pushes a bucket's gradients as one
message (as DDP's buckets: few messages for many small tensors, still overlapping with
backward for large models) and the server answers a pull bucket by bucket. Since a bucket
is one contiguous range of the workers' flat buffer, a worker sends a large parameter's
gradient straight from its storage and receives the pulled values straight into its
parameter buffer, without staging copies. Each server keeps its buckets back to back in
a flat buffer of its own.

A *key* is the part of one parameter inside one bucket; the server's optimizer holds one
1-D parameter per key, so every key belongs to one optimizer param group.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from dtrain.errors import ConfigError

MAX_BUCKET_BYTES = 4 << 20
MIN_BUCKET_ELEMENTS = 256
BUCKETS_PER_SERVER = 16


@dataclass(frozen=True)
class Key:
    """The part of parameter `param` (index in optimizer order) inside one bucket.

    Attributes:
        param: index of the parameter in the optimizer's order (groups flattened).
        group: the optimizer param group the parameter belongs to.
        start: the first element of the flattened parameter the key holds.
        numel: elements held (a contiguous range of the flattened parameter).
        offset: where the key starts in its server's flat buffer.
    """

    param: int
    group: int
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of the workers' flat buffer held by one server.

    Attributes:
        start: where the bucket starts in the workers' flat buffer.
        numel: elements of the bucket.
        offset: where it starts in its server's flat buffer.
        keys: the indices of its keys in the server's key list (consecutive).
    """

    start: int
    numel: int
    offset: int
    keys: range


@dataclass
class ServerShard:
    """What one server holds: its buckets back to back in a flat buffer of `numel`
    elements, and their keys in the same order."""

    buckets: list[Bucket] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)
    numel: int = 0


@dataclass(frozen=True)
class Plan:
    """The placement of every bucket on the servers.

    Attributes:
        shards: what each server holds.
        offsets: where each parameter starts in the workers' flat buffer.
        element_size: bytes per element.
    """

    shards: tuple[ServerShard, ...]
    offsets: tuple[int, ...]
    element_size: int

    @property
    def bytes_per_server(self) -> list[int]:
        """Bytes of parameters each server holds (and receives per worker per step)."""
        return [s.numel * self.element_size for s in self.shards]

    @property
    def balance(self) -> float:
        """max / mean bytes per server (1.0 is perfect)."""
        sizes = self.bytes_per_server
        return max(sizes) / (sum(sizes) / len(sizes))


def bucket_elements(total: int, servers: int, element_size: int = 4) -> int:
    """The bucket size in elements for `total` elements over `servers` servers."""
    largest = MAX_BUCKET_BYTES // element_size
    if servers == 1:
        return largest  # nothing to balance: only the message size bounds a bucket
    target = math.ceil(total / (servers * BUCKETS_PER_SERVER))
    return max(MIN_BUCKET_ELEMENTS, min(target, largest))


def plan(sizes: list[int], groups: list[int], servers: int, element_size: int = 4) -> Plan:
    """Deal the parameters (`sizes` in elements, optimizer order) over `servers` servers.

    Args:
        sizes: numel of each parameter, in optimizer order.
        groups: the param-group index of each parameter.
        servers: number of servers K.
        element_size: bytes per element.

    Raises:
        ConfigError: there are fewer buckets than servers (a server would hold nothing).
    """
    offsets = (0, *itertools.accumulate(sizes))
    total = offsets[-1]
    size = bucket_elements(total, servers, element_size)
    starts = range(0, total, size)
    if len(starts) < servers:
        raise ConfigError(
            f"The model's parameters make {len(starts)} bucket(s) of up to {size} elements, "
            f"fewer than the {servers} servers, so some server would hold nothing; use "
            f"--servers {max(1, len(starts))} or fewer."
        )
    loads = [0] * servers
    owned: list[list[int]] = [[] for _ in range(servers)]
    # Largest first (only the last bucket is smaller), each to the least loaded server;
    # ties broken by the lowest index.
    for start in sorted(starts, key=lambda s: (-min(size, total - s), s)):
        server = min(range(servers), key=lambda s: (loads[s], s))
        loads[server] += min(size, total - start)
        owned[server].append(start)
    shards = []
    for starts_of_server in owned:
        shard = ServerShard()
        for start in sorted(starts_of_server):
            _add_bucket(shard, start, min(size, total - start), offsets, groups)
        shards.append(shard)
    return Plan(tuple(shards), offsets[:-1], element_size)


def _add_bucket(
    shard: ServerShard, start: int, numel: int, offsets: tuple[int, ...], groups: list[int]
) -> None:
    """Append the bucket [start, start + numel) of the workers' buffer, and its keys."""
    first_key = len(shard.keys)
    end = start + numel
    param = bisect.bisect_right(offsets, start) - 1  # the parameter holding `start`
    while param < len(groups) and offsets[param] < end:
        lo, hi = max(start, offsets[param]), min(end, offsets[param + 1])
        if lo < hi:  # parameters without elements hold nothing
            offset = shard.numel + lo - start
            shard.keys.append(Key(param, groups[param], lo - offsets[param], hi - lo, offset))
        param += 1
    shard.buckets.append(Bucket(start, numel, shard.numel, range(first_key, len(shard.keys))))
    shard.numel += numel
