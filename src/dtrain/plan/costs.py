"""The cost model's formulas: pure functions of sizes, rates and link figures.

Every function here is a documented formula, free of measurement and of torch, so it can
be checked by hand (tests/test_plan.py does). Times are seconds, sizes bytes, bandwidths
bytes per second. The planner feeds them the calibrated figures (`dtrain.plan.calibrate`,
`dtrain.plan.links`); docs/plan.md lists them with their sources.
"""

from __future__ import annotations

import math

DDP_FIRST_BUCKET = 2**20
"""DDP's first gradient bucket (1 MiB; Li et al., VLDB 2020): ready soonest, sent first."""
DDP_BUCKET = 25 * 2**20
"""DDP's other gradient buckets (25 MiB)."""
POWERSGD_MIN_RATE = 2.0
"""PowerSGD sends a matrix as factors only where they are under 1/2 of it (torch's
default, `dtrain.parallel.compression.MIN_COMPRESSION_RATE`)."""


def ring_allreduce_bytes(size: float, n: int) -> float:
    """Bytes each of `n` ranks sends (and receives) in a ring all-reduce of `size` bytes:
    2(n-1)/n x S (a reduce-scatter then an all-gather; bandwidth-optimal)."""
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def ring_allreduce_seconds(size: float, n: int, bus_bandwidth: float, latency: float) -> float:
    """A ring all-reduce of `size` bytes over `n` ranks: 2(n-1)/n x S / B + latency, with
    B the bus bandwidth (the nccl-tests definition, so that 2(n-1)/n S / B is the time)."""
    if n <= 1:
        return 0.0
    return latency + ring_allreduce_bytes(size, n) / bus_bandwidth


def ddp_buckets(size: float) -> list[float]:
    """Sizes of DDP's gradient buckets for `size` bytes of gradients, in the order they are
    reduced: the first 1 MiB, then 25 MiB each (the last one smaller)."""
    if size <= 0:
        return []
    first = min(size, DDP_FIRST_BUCKET)
    rest = size - first
    full = int(rest // DDP_BUCKET)
    tail = rest - full * DDP_BUCKET
    return [first] + [DDP_BUCKET] * full + ([tail] if tail > 0 else [])


def exposed_after_overlap(bucket_seconds: list[float], backward_seconds: float) -> float:
    """Communication that backward does not hide, for buckets reduced while backward runs.

    Assumption (DDP's design): gradients become ready evenly over backward, in bucket
    order; a bucket's all-reduce starts when its last gradient is ready and the previous
    bucket's is done; all-reduces overlap compute fully. So bucket i (holding the fraction
    f_i of the gradients) is ready at backward x (f_1 + ... + f_i); the last one is ready
    when backward ends and is never hidden. Returns how long after backward ends the last
    all-reduce finishes.
    """
    if not bucket_seconds:
        return 0.0
    total = len(bucket_seconds)
    clock = 0.0
    for i, seconds in enumerate(bucket_seconds, start=1):
        ready = backward_seconds * i / total
        clock = max(clock, ready) + seconds
    return max(0.0, clock - backward_seconds)


def pipeline_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Fraction of a pipeline step each stage idles (GPipe; Huang et al. 2019):
    (p-1)/(m+p-1); interleaved 1F1B with v stages per rank (Narayanan et al. 2021):
    (p-1)/(v m + p-1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def pipeline_slots(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Per-rank time slots of a pipeline step, in units of one micro-batch's forward and
    backward on one rank: m for the work plus (p-1)/v for the fill and drain."""
    return microbatches + (stages - 1) / virtual


def micro_batches_held(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` (from 0) holds at its peak: all m
    under GPipe; under 1F1B (and interleaved) at most p - stage, the micro-batches still
    in flight below it."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)


def zero_model_states(
    params: float, grads: float, optim: float, n: int, stage: int, ddp_buckets: bool = True
) -> float:
    """Model-state bytes per rank under ZeRO `stage` (0 = plain data parallel) over `n`
    ranks, from the actual byte counts (Rajbhandari et al. SC'20, table 1, with fp32
    weights: 4 psi parameters, 4 psi gradients, the optimizer's own state):

    - 0 (ddp): P + G + O, plus G again for DDP's gradient buckets at the peak of backward;
    - 1: P + G + O/n (+ the buckets);
    - 2: P + (G + O)/n at the peak (parameters held gathered from forward to backward);
    - 3: (P + G + O)/n.
    """
    bucket = grads if ddp_buckets and stage <= 1 else 0.0
    if stage == 0:
        return params + grads + optim + bucket
    if stage == 1:
        return params + grads + optim / n + bucket
    if stage == 2:
        return params + (grads + optim) / n
    return (params + grads + optim) / n


def greedy_partition_share(sizes: list[float], n: int) -> float:
    """The fullest rank's share when whole tensors of `sizes` are dealt to `n` ranks the
    way `ZeroRedundancyOptimizer` deals them (largest first, each to the least loaded
    rank so far): 1/n for many equal tensors, more when one tensor dominates."""
    total = sum(sizes)
    if n <= 1 or total <= 0:
        return 1.0
    loads = [0.0] * n
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return max(loads) / total


def ps_step_seconds(model_bytes: float, workers: int, servers: int, bandwidth: float) -> float:
    """A parameter-server step's communication (BytePS, Jiang et al. OSDI'20):
    max(M/B, nM/(kB)): each worker pushes and pulls M; the servers together receive and
    send nM, each k-th of it through its own link."""
    return max(model_bytes / bandwidth, workers * model_bytes / (servers * bandwidth))


def towers_replication_bytes(params: float, copies: int) -> float:
    """Bytes copied per step by single-process towers with `copies` replicas that are
    copies (a tower on the parameter device uses the variables themselves): the variables
    to each copy before forward, and each copy's gradients back after backward."""
    return 2 * copies * params


def hierarchical_seconds(
    size: float,
    per_node: int,
    nodes: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    cross: float = 1.0,
) -> float:
    """ddp --hierarchical: reduce inside each machine to its leader, all-reduce across the
    leaders, broadcast inside: 2 S / B_in + 2(h-1)/h x c S / B_out, plus each step's
    latency. `intra` and `inter` are (bandwidth, latency) of the links inside and between
    machines; `cross` (c) the bytes sent across per byte of the message (1/2 when a 16-bit
    --grad-compression casts what crosses machines)."""
    inside = 0.0
    if per_node > 1:
        inside = 2 * (intra[1] + size / intra[0])
    latency = inter[1] * 2 * (nodes - 1)
    return inside + ring_allreduce_seconds(cross * size, nodes, inter[0], latency)


def flat_multinode_seconds(
    size: float, per_node: int, nodes: int, inter: tuple[float, float]
) -> float:
    """A flat ring all-reduce over every rank of `nodes` machines: the ring crosses the
    links between machines, so it runs at their speed; each of its 2(W-1) steps pays their
    latency (W = per_node x nodes ranks)."""
    world = per_node * nodes
    return ring_allreduce_seconds(size, world, inter[0], inter[1] * 2 * (world - 1))


def cast_bytes_factor(compression: str) -> float:
    """Bytes a --grad-compression sends per fp32 gradient byte by casting: 1/2 for fp16
    and bf16 (2 bytes a value instead of 4), 1 for the others (PowerSGD sends fewer values
    instead: `powersgd_values`)."""
    return 0.5 if compression in ("fp16", "bf16") else 1.0


def powersgd_matrices(shapes: list[tuple[int, ...]], rank: int) -> list[tuple[int, int, int]]:
    """(m, n, r) of each parameter PowerSGD sends as factors, as torch's `powerSGD_hook`
    picks them: a tensor of 2 or more dimensions, viewed as m = shape[0] rows of n values,
    at rank r = min(rank, m, n), where m n exceeds 2 (m + n) r; vectors, and matrices
    that would gain less, are sent whole."""
    out = []
    for shape in shapes:
        if len(shape) < 2:
            continue
        m = shape[0]
        n = math.prod(shape[1:])
        r = min(rank, m, n)
        if m * n > POWERSGD_MIN_RATE * (m + n) * r:
            out.append((m, n, r))
    return out


def powersgd_values(shapes: list[tuple[int, ...]], rank: int) -> float:
    """Values PowerSGD all-reduces per step (Vogels et al., NeurIPS 2019): (m + n) r per
    matrix it compresses (P = M Q, m x r, and Q = M^T P, n x r) instead of m n, every
    other value whole."""
    values = sum(math.prod(shape) for shape in shapes)
    for m, n, r in powersgd_matrices(shapes, rank):
        values -= m * n - (m + n) * r
    return float(values)


def powersgd_flops(shapes: list[tuple[int, ...]], rank: int) -> float:
    """FLOPs PowerSGD adds per step, per matrix it compresses: 3 x 2 m n r of matmuls
    (P = M Q, Q = M^T P, the approximation P Q^T), 2 m r^2 to orthogonalise P
    (Gram-Schmidt), 2 m n for the error feedback (add the last error, keep the new one)."""
    matrices = powersgd_matrices(shapes, rank)
    return float(sum(6 * m * n * r + 2 * m * r * r + 2 * m * n for m, n, r in matrices))


def local_sgd_seconds(sync_seconds: float, sync_every: int) -> float:
    """Communication per step of local SGD: one all-reduce of the parameters and buffers
    (`sync_seconds`) every H = `sync_every` steps, so sync / H (DiLoCo all-reduces the
    parameters' changes instead: the same bytes)."""
    return sync_seconds / sync_every


CONTEXT_KV_SHARE = 2 / 17
"""The keys and values' share of what a transformer block keeps for backward: per token a
block of width d keeps about 17 d values (its norms' and projections' inputs, the
attention's queries, keys, values and output, the MLP's 4 d hidden twice) of which the
keys and values are 2 d (measured: 134.3 MiB kept by the bundled GPT at 2048 tokens,
17.1 d per token per layer)."""


def context_kv_messages(activation_bytes: float, units: int) -> list[float]:
    """The key or value tensors one context-parallel rank gathers in a step: one per block
    and per kind (keys, values), each the whole sequence's, from `activation_bytes` (what
    the whole samples keep for backward) over `units` blocks. Each is gathered in forward
    and again in backward's recompute, and its gradient reduce-scattered."""
    units = max(units, 1)
    return [CONTEXT_KV_SHARE * activation_bytes / (2 * units)] * (2 * units)


EXPERT_ALL_TO_ALLS = 4
"""All-to-alls of routed rows per MoE layer per step under --ep: forward sends each row to
its expert's rank and the output back; backward sends their gradients the same two ways
(`dtrain.parallel.all_to_all`)."""


def expert_share(expert_bytes: float, param_bytes: float) -> float:
    """The experts' share s = E / P of the parameter bytes (0 for a dense model): under
    --ep the data-parallel wrappers hold and send only the other 1 - s."""
    return expert_bytes / param_bytes if param_bytes > 0 else 0.0


def expert_model_states(params: float, grads: float, optim: float, share: float, ep: int) -> float:
    """Model-state bytes per rank of the experts under --ep over `ep` ranks: their
    parameters, gradients and optimizer state (the `share` s of each; the optimizer's
    state is per parameter value), held at 1/ep on every rank and sharded no further by
    FSDP: s (P + G + O) / ep."""
    return share * (params + grads + optim) / ep


def samples_per_second(global_batch: int, step_seconds: float) -> float:
    """Throughput of a step of `global_batch` samples."""
    return global_batch / step_seconds if step_seconds > 0 else math.inf
