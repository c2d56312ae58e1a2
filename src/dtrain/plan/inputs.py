"""What every layout's estimate is made of: the prediction's terms (`Estimate`) and the
measured figures they are computed from (`Inputs`), with the helpers all strategies use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtrain.plan import costs
from dtrain.plan.calibrate import Calibration, StepTime
from dtrain.plan.layouts import Layout
from dtrain.plan.links import Links, bus_factor
from dtrain.plan.machine import Machine
from dtrain.plan.weigh import TensorFigures


@dataclass
class Estimate:
    """The prediction for one layout."""

    layout: Layout
    per_device_batch: float
    """Samples one device computes per forward (a micro-batch under a pipeline)."""
    data_seconds: float
    """Loading the step's batch."""
    compute_seconds: float
    """t1: forward + backward on the busiest rank."""
    communication_seconds: float
    """t2 not hidden by compute."""
    optimizer_seconds: float
    idle_seconds: float
    """A pipeline's fill and drain (the bubble)."""
    model_state_bytes: float
    """Parameters, gradients and optimizer state the rank holds at its peak (what
    `--memory-report` counts)."""
    activation_bytes: float
    wait_seconds: float = 0.0
    """Lost to jitter: a step in lockstep runs at the pace of its slowest rank."""
    overhead_seconds: float = 0.0
    """The torch wrapper's own work per step (DDP, FSDP2, DTensor), measured on one rank,
    and the Engine's (`dtrain.plan.engine_probe`)."""
    buffer_bytes: float = 0.0
    """Working copies beside the model states: DDP's gradient buckets, the towers'
    replicas, the replicas' reduction buffers of a hybrid layout."""
    crowd: float = 1.0
    """How many times slower each process runs because the layout's processes want more
    threads than the machine has cores (1 on GPUs); already applied to the times."""
    bubble: float = 0.0
    fits: bool = True
    global_batch: int = 0

    @property
    def step_seconds(self) -> float:
        """The whole step."""
        return (
            self.data_seconds
            + self.compute_seconds
            + self.communication_seconds
            + self.optimizer_seconds
            + self.idle_seconds
            + self.wait_seconds
            + self.overhead_seconds
        )

    @property
    def samples_per_second(self) -> float:
        """Global samples per second."""
        return costs.samples_per_second(self.global_batch, self.step_seconds)

    @property
    def memory_bytes_per_rank(self) -> float:
        """Model states, working buffers and activations on the fullest rank."""
        return self.model_state_bytes + self.buffer_bytes + self.activation_bytes

    def crowded(self, factor: float) -> None:
        """Stretch every time of the step by `factor` (processes outnumbering cores)."""
        self.crowd = factor
        for name in (
            "data_seconds", "compute_seconds", "communication_seconds", "optimizer_seconds",
            "idle_seconds", "wait_seconds", "overhead_seconds",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) * factor)


@dataclass
class Inputs:
    """Everything an estimate reads."""

    calibration: Calibration
    links: Links
    machine: Machine
    global_batch: int
    tensor: TensorFigures | None

    def step(self, batch: float, processes: int, cp: int = 1) -> StepTime:
        """Measured step parts at `batch` samples per device with `processes` per machine.
        With `cp` context ranks `batch` counts samples' worth of tokens: the step of
        `batch` x `cp` whole samples, its forward and backward cut `cp` ways."""
        whole = self.calibration.step(
            max(1, round(batch * cp)), self.machine.threads(processes), True
        )
        if cp == 1:
            return whole
        return replace(whole, forward=whole.forward / cp, backward=whole.backward / cp)

    def single_step(self, batch: float) -> StepTime:
        """Measured step parts of a one-process run."""
        return self.calibration.step(max(1, round(batch)), self.machine_single_threads, False)

    @property
    def machine_single_threads(self) -> int:
        return 0 if self.machine.gpus else self.machine.single_threads

    def crowd(self, layout: Layout) -> float:
        """How many times slower each process of `layout` runs on the CPU because its
        processes (parameter servers included) want more threads than there are cores:
        processes x threads / cores, at least 1 (each gets its share of the cores; a
        message waits for its receiver's turn). 1 on GPUs."""
        if self.machine.gpus:
            return 1.0
        processes = layout.processes_per_node if layout.strategy != "towers" else 1
        threads = self.machine.threads(processes) if processes > 1 else self.machine.single_threads
        return max(1.0, processes * max(1, threads) / self.machine.cores)

    def jitter_wait(self, ranks: int, busy: float, shared: bool = True) -> float:
        """Time lost to jitter by `ranks` ranks in lockstep that compute for `busy`
        seconds: each rank's pauses (the measured jitter share of its time, `shared` with
        other ranks or alone) stall every rank, so the losses add up: ranks x jitter x
        busy (for rare, short pauses)."""
        return ranks * self.calibration.jitter(shared) * busy

    def overhead(self, wrapper: str) -> float:
        """Seconds per step the torch `wrapper` adds by itself (0 if not measured)."""
        return self.calibration.overheads.get(wrapper, 0.0)

    def local(self, op: str, size: float, n: int | None = None) -> float:
        """One `op` of `size` bytes over `n` ranks of this machine (default: the probed
        count): the link probe's time, measured back to back, with its latency raised to
        the cost of one synchronization in lockstep where that is higher (ranks that
        compute between their collectives arrive apart and wait for each other)."""
        seconds = self.links.seconds(op, size, n)
        if seconds == 0:  # a group of one rank
            return 0.0
        return seconds + max(0.0, self.calibration.sync_seconds - self.links.seconds(op, 0, n))

    def collective(self, op: str, size: float, n: int, layout: Layout, stride: int = 1) -> float:
        """One `op` of `size` bytes over a group of `n` ranks of `layout`, `stride` ranks
        apart (the product of the mesh's inner dimensions: tp for a dp group, dp x tp for
        the pipeline's stages): on the measured links inside a machine, or, when the group
        spans machines, as a ring through the links between them, whose every step waits
        for them (bus bytes over their bandwidth, shared with the other groups that cross
        them at once, `crossing_groups`; a latency per step). gloo's
        reduce-scatter (the CPU's) moves an all-reduce's bytes, twice a ring
        reduce-scatter's (counted on the wire: 2 S for 2 ranks), so across machines it
        costs an all-reduce; inside one the link probe measured the op itself."""
        if op == "all_reduce":
            return self.allreduce(size, n, layout, stride)
        if not spans_machines(n, stride, layout):
            return self.local(op, size, n)
        if op == "reduce_scatter" and not self.machine.gpus:
            return self.allreduce(size, n, layout, stride)
        bandwidth, latency = self.machine.inter_node
        steps = n - 1 if op in ("all_gather", "reduce_scatter") else 1
        shared = crossing_groups(stride, layout)
        return latency * steps + bus_factor(op, n) * shared * size / bandwidth

    def stage_send(self, size: float, layout: Layout) -> float:
        """One pipeline hand-over of `size` bytes: between machines when the stages span
        them (the pipeline is the mesh's outer dimension; the slowest hand-over paces it)."""
        if not spans_machines(layout.pp, layout.dp * layout.tp, layout):
            return self.local("send_recv", size)
        bandwidth, latency = self.machine.inter_node
        return latency + size / bandwidth

    def allreduce(
        self, size: float, n: int, layout: Layout, stride: int = 1, cast: float = 1.0
    ) -> float:
        """One all-reduce of `size` bytes over a group of `n` ranks `stride` apart: inside
        a machine on the measured links; the whole job across machines as a flat ring or
        hierarchically; a smaller group across machines as a ring through their links,
        which it shares with the other groups that cross them at once (`crossing_groups`).
        `cast` is the bytes sent per byte of the message (`costs.cast_bytes_factor`):
        under --hierarchical only the bytes that cross machines are cast."""
        if not spans_machines(n, stride, layout):
            return self.local("all_reduce", cast * size, n)
        bandwidth, latency = self.machine.inter_node
        if n < layout.world:
            shared = crossing_groups(stride, layout) * cast * size
            return costs.ring_allreduce_seconds(shared, n, bandwidth, latency * 2 * (n - 1))
        intra = (self.links.bus_bandwidth, self.links.latency_seconds)
        if layout.hierarchical:
            return costs.hierarchical_seconds(
                size, layout.nproc, layout.nnodes, intra, self.machine.inter_node, cast
            )
        return costs.flat_multinode_seconds(
            cast * size, layout.nproc, layout.nnodes, self.machine.inter_node
        )


def spans_machines(n: int, stride: int, layout: Layout) -> bool:
    """True if a group of `n` ranks `stride` apart holds ranks of more than one machine
    (ranks fill machines in order, `layout.nproc` each)."""
    return layout.nnodes > 1 and stride * (n - 1) + 1 > layout.nproc


def crossing_groups(stride: int, layout: Layout) -> int:
    """How many groups of ranks `stride` apart send through a machine's link at once: the
    groups of one collective run together, and a machine's ranks in different groups (at
    most its `nproc`) each carry their group's ring across. hsdp's replica groups, one per
    shard, are `shard_size` apart: a machine of g ranks sends g shards' all-reduces, 2(h-1)/h
    S in all (docs/benchmarks.md measured 1.05 S per host at 2x2)."""
    return min(layout.nproc, stride)


def activation_bytes(inputs: Inputs, batch: float) -> float:
    return inputs.calibration.figures.activation_bytes_per_sample * batch


def overlapped(inputs: Inputs, layout: Layout, parts: list[float], window: float) -> float:
    """Exposed time of collectives `parts` issued during a compute `window`."""
    if inputs.machine.overlaps(layout.processes_per_node):
        return costs.exposed_after_overlap(parts, window)
    return sum(parts)
