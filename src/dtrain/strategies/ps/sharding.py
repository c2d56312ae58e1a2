"""Partition the parameters over the servers by bytes, large tensors cut into chunks.

As in BytePS (Jiang et al., OSDI 2020) and MXNet's KVStore, a server's load is the bytes
it receives and sends each step, so tensors are cut into chunks (at most ~4 MiB, smaller
for small models so that K servers still get about 16 chunks each) and the chunks are
dealt largest first to the least loaded server (LPT scheduling). The imbalance is then at
most one chunk, i.e. max/mean <= 1 + 1/16 when no tensor is smaller than a chunk.

A *key* is the chunks of one parameter that live on one server, concatenated in parameter
order. Each server stores its keys back to back in one flat buffer; consecutive keys form
*buckets* of up to ~4 MiB, the unit a worker pushes in one message (as DDP's buckets:
few messages for many small tensors, and still overlap with backward for large models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtrain.errors import ConfigError

MAX_CHUNK_BYTES = 4 << 20
MIN_CHUNK_ELEMENTS = 256
CHUNKS_PER_SERVER = 16


@dataclass(frozen=True)
class Key:
    """The part of parameter `param` (index in optimizer order) held by one server.

    Attributes:
        param: index of the parameter in the optimizer's order (groups flattened).
        group: the optimizer param group the parameter belongs to.
        ranges: (start, length) element ranges of the flattened parameter, ascending.
        offset: where the key starts in its server's flat buffer.
    """

    param: int
    group: int
    ranges: tuple[tuple[int, int], ...]
    offset: int

    @property
    def numel(self) -> int:
        """Elements carried by the key."""
        return sum(length for _, length in self.ranges)


@dataclass(frozen=True)
class Bucket:
    """Consecutive keys of one server pushed as one message (``keys[first:last]``)."""

    first: int
    last: int
    offset: int
    numel: int


@dataclass
class ServerShard:
    """What one server holds: its keys, back to back in a flat buffer of `numel` elements,
    and the buckets (at most ~4 MiB) in which workers push their gradients."""

    keys: list[Key] = field(default_factory=list)
    numel: int = 0
    buckets: list[Bucket] = field(default_factory=list)

    def add_buckets(self, limit: int) -> None:
        """Group the keys into buckets of at most `limit` elements (or one key)."""
        first = 0
        for i, key in enumerate(self.keys):
            start = self.keys[first].offset
            if i > first and key.offset + key.numel - start > limit:
                self.buckets.append(Bucket(first, i, start, key.offset - start))
                first = i
        if self.keys:
            start = self.keys[first].offset
            self.buckets.append(Bucket(first, len(self.keys), start, self.numel - start))


@dataclass(frozen=True)
class Plan:
    """The placement of every parameter chunk on the servers."""

    shards: tuple[ServerShard, ...]
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


def chunk_elements(total: int, servers: int, element_size: int = 4) -> int:
    """The chunk size in elements for `total` elements over `servers` servers."""
    largest = MAX_CHUNK_BYTES // element_size
    if servers == 1:
        return largest  # nothing to balance: only the message size bounds a chunk
    target = math.ceil(total / (servers * CHUNKS_PER_SERVER))
    return max(MIN_CHUNK_ELEMENTS, min(target, largest))


def plan(sizes: list[int], groups: list[int], servers: int, element_size: int = 4) -> Plan:
    """Deal the parameters (`sizes` in elements, optimizer order) over `servers` servers.

    Args:
        sizes: numel of each parameter, in optimizer order.
        groups: the param-group index of each parameter.
        servers: number of servers K.
        element_size: bytes per element (for the report).

    Raises:
        ConfigError: there are fewer chunks than servers (a server would hold nothing).
    """
    chunk = chunk_elements(sum(sizes), servers, element_size)
    pieces = [
        (min(chunk, size - start), param, start)
        for param, size in enumerate(sizes)
        for start in range(0, size, chunk)
    ]
    if len(pieces) < servers:
        raise ConfigError(
            f"The model's parameters make {len(pieces)} chunk(s) of up to {chunk} elements, "
            f"fewer than the {servers} servers, so some server would hold nothing; use "
            f"--servers {len(pieces)} or fewer."
        )
    loads = [0] * servers
    owned: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(servers)]
    # Largest first, each to the least loaded server; ties broken by the lowest index.
    for length, param, start in sorted(pieces, key=lambda p: (-p[0], p[1], p[2])):
        server = min(range(servers), key=lambda s: (loads[s], s))
        loads[server] += length
        owned[server].setdefault(param, []).append((start, length))
    shards = []
    for ranges_by_param in owned:
        shard = ServerShard()
        for param in sorted(ranges_by_param):
            key = Key(param, groups[param], tuple(sorted(ranges_by_param[param])), shard.numel)
            shard.keys.append(key)
            shard.numel += key.numel
        shard.add_buckets(MAX_CHUNK_BYTES // element_size)
        shards.append(shard)
    return Plan(tuple(shards), element_size)
