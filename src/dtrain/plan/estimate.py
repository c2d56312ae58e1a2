"""Predicted step time and memory of one layout, from the calibration and the formulas.

Per step, t1 is the compute (forward + backward at the per-device batch, measured) and t2
the communication that compute does not hide; the step is t1 + t2 + the optimizer (+ the
pipeline's idle fill and drain). Each strategy's terms are in its function below; the
formulas themselves are in `dtrain.plan.costs` and docs/plan.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dtrain.plan import costs
from dtrain.plan.calibrate import Calibration, StepTime
from dtrain.plan.layouts import Layout
from dtrain.plan.links import Links
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
    activation_bytes: float
    wait_seconds: float = 0.0
    """Lost to jitter: a step in lockstep runs at the pace of its slowest rank."""
    overhead_seconds: float = 0.0
    """The torch wrapper's own work per step (DDP, FSDP2, DTensor), measured on one rank."""
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
        """Model states plus activations on the fullest rank."""
        return self.model_state_bytes + self.activation_bytes


@dataclass
class Inputs:
    """Everything an estimate reads."""

    calibration: Calibration
    links: Links
    machine: Machine
    global_batch: int
    tensor: TensorFigures | None

    def step(self, batch: float, processes: int) -> StepTime:
        """Measured step parts at `batch` samples per device with `processes` per machine."""
        return self.calibration.step(max(1, round(batch)), self.machine.threads(processes), True)

    def single_step(self, batch: float) -> StepTime:
        """Measured step parts of a one-process run."""
        return self.calibration.step(max(1, round(batch)), self.machine_single_threads, False)

    @property
    def machine_single_threads(self) -> int:
        return 0 if self.machine.gpus else self.machine.single_threads

    def overhead(self, wrapper: str) -> float:
        """Seconds per step the torch `wrapper` adds by itself (0 if not measured)."""
        return self.calibration.overheads.get(wrapper, 0.0)

    def allreduce(self, size: float, n: int, layout: Layout) -> float:
        """One all-reduce of `size` bytes over `n` ranks (across machines when the layout
        spans several: flat ring or hierarchical)."""
        if layout.nnodes == 1 or n <= layout.nproc:
            return self.links.seconds("all_reduce", size, n)
        intra = (self.links.bus_bandwidth, self.links.latency_seconds)
        if layout.hierarchical:
            return costs.hierarchical_seconds(
                size, layout.nproc, layout.nnodes, intra, self.machine.inter_node
            )
        return costs.flat_multinode_seconds(
            size, layout.nproc, layout.nnodes, self.machine.inter_node
        )


def _wait(step: StepTime, ranks: int, busy: float) -> float:
    """Time lost to jitter by `ranks` ranks in lockstep that compute for `busy` seconds:
    each rank's pauses (the measured jitter share of its time) stall every rank, so the
    losses add up: ranks x jitter x busy (for rare, short pauses)."""
    return ranks * step.jitter * busy


def _activations(inputs: Inputs, batch: float) -> float:
    return inputs.calibration.figures.activation_bytes_per_sample * batch


def _single(inputs: Inputs, layout: Layout) -> Estimate:
    f = inputs.calibration.figures
    s = inputs.single_step(inputs.global_batch)
    states = costs.zero_model_states(f.param_bytes, f.grad_bytes, f.optimizer_bytes, 1, 0, False)
    return Estimate(
        layout, inputs.global_batch, s.data, s.compute, 0.0, s.optimizer, 0.0, states,
        _activations(inputs, inputs.global_batch), wait_seconds=_wait(s, 1, s.compute),
    )  # fmt: skip


def _towers(inputs: Inputs, layout: Layout) -> Estimate:
    """On GPUs the towers compute their shares at once (one device each); on the CPU one
    after another on the same cores (dtrain's towers do not thread there). The variables
    are copied to each replica that is a copy, and its gradients back."""
    f = inputs.calibration.figures
    t = layout.towers
    b = inputs.global_batch / t
    part = inputs.single_step(b)
    if inputs.machine.gpus:
        compute, copies, wait = part.compute, t, _wait(part, t, part.compute)
    else:
        compute, copies, wait = t * part.compute, t - 1, _wait(part, 1, t * part.compute)
    moved = costs.towers_replication_bytes(f.param_bytes, copies)
    whole = inputs.single_step(inputs.global_batch)
    states = f.param_bytes + f.grad_bytes + f.optimizer_bytes + moved
    return Estimate(
        layout, b, whole.data, compute, moved / inputs.calibration.copy_bandwidth,
        whole.optimizer, 0.0, states, _activations(inputs, inputs.global_batch),
        wait_seconds=wait,
    )  # fmt: skip


def _overlapped(inputs: Inputs, layout: Layout, parts: list[float], window: float) -> float:
    """Exposed time of collectives `parts` issued during a compute `window`."""
    if inputs.machine.overlaps(layout.processes_per_node):
        return costs.exposed_after_overlap(parts, window)
    return sum(parts)


def _data_parallel(inputs: Inputs, layout: Layout) -> Estimate:
    """ddp, zero1: DDP's bucketed all-reduce overlapped with backward; zero1 adds the
    broadcast of every parameter from the rank that updated it and updates 1/N."""
    f = inputs.calibration.figures
    n = layout.world
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node)
    buckets = [inputs.allreduce(size, n, layout) for size in costs.ddp_buckets(f.grad_bytes)]
    comm = _overlapped(inputs, layout, buckets, s.backward)
    optimizer = s.optimizer
    stage = 0
    if layout.strategy == "zero1":
        stage = 1
        optimizer /= n
        comm += sum(inputs.links.seconds("broadcast", size, n) for size in f.tensor_bytes)
    states = costs.zero_model_states(f.param_bytes, f.grad_bytes, f.optimizer_bytes, n, stage)
    return Estimate(
        layout, b, s.data, s.compute, comm, optimizer, 0.0, states, _activations(inputs, b),
        wait_seconds=_wait(s, n, s.compute), overhead_seconds=inputs.overhead("ddp"),
    )  # fmt: skip


def _sharded(inputs: Inputs, layout: Layout) -> Estimate:
    """zero2, zero3, hsdp (FSDP2, unit by unit): forward all-gathers each unit (prefetched
    during the previous unit's forward); backward reduce-scatters each unit's gradients
    (and zero3 all-gathers the unit again first: 1.5x the traffic)."""
    f = inputs.calibration.figures
    n = layout.world
    shard = layout.shard_size or n
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node)
    stage = 2 if layout.strategy == "zero2" else 3

    def gather(size: float) -> float:
        return inputs.links.seconds("all_gather", size, shard)

    def scatter(size: float) -> float:
        seconds = inputs.links.seconds("reduce_scatter", size, shard)
        if shard < n:  # hsdp: each shard's gradients are averaged across the replicas
            seconds += inputs.allreduce(size / shard, n // shard * layout.nproc, layout)
        return seconds

    units = f.unit_bytes
    forward = [gather(u) for u in units]
    backward = [(gather(u) if stage == 3 else 0.0) + scatter(u) for u in reversed(units)]
    comm = forward[0] + _overlapped(inputs, layout, forward[1:], s.forward)
    comm += _overlapped(inputs, layout, backward, s.backward)
    states = costs.zero_model_states(f.param_bytes, f.grad_bytes, f.optimizer_bytes, shard, stage)
    return Estimate(
        layout, b, s.data, s.compute, comm, s.optimizer / shard, 0.0, states,
        _activations(inputs, b), wait_seconds=_wait(s, n, s.compute),
        overhead_seconds=inputs.overhead("zero2" if stage == 2 else "zero3"),
    )  # fmt: skip


def _parameter_server(inputs: Inputs, layout: Layout) -> Estimate:
    """Workers push gradients and pull parameters through the servers (PS formula on the
    measured send/recv bandwidth, plus one round trip's latency); each server updates its
    1/K of the model, on the critical path of a synchronous step. On the CPU the K server
    processes share the machine's cores with the N workers: with more processes than
    cores, each worker computes (N + K) / cores times slower (the servers' receiving
    threads poll even while they wait)."""
    f = inputs.calibration.figures
    n, k = layout.nproc, layout.servers
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node)
    crowd = 1.0
    if not inputs.machine.gpus:
        crowd = max(1.0, layout.processes_per_node / max(inputs.machine.cores, n))
    bandwidth = inputs.links.p2p_bandwidth
    comm = costs.ps_step_seconds(f.param_bytes, n, k, bandwidth)
    comm += 2 * inputs.links.seconds("send_recv", 0)
    states = f.param_bytes + f.grad_bytes
    return Estimate(
        layout, b, s.data, s.compute * crowd, comm, s.optimizer / k, 0.0, states,
        _activations(inputs, b), wait_seconds=_wait(s, n, s.compute * crowd),
    )  # fmt: skip


def _tensor_share(tensor: TensorFigures | None, tp: int) -> float:
    """Share of the compute one of `tp` tensor-parallel ranks does."""
    if tensor is None or tp == 1:
        return 1.0
    return 1 - tensor.time_share * (1 - 1 / tp)


def _tensor_comm(inputs: Inputs, layout: Layout, batch: float, repeats: int) -> float:
    """Megatron's activation all-reduces: one per row-split layer in forward, one per
    column-split layer in backward, each of the batch's activations at that layer."""
    t = inputs.tensor
    if t is None or layout.tp == 1:
        return 0.0
    sizes = [x * batch for x in t.forward_bytes_per_sample + t.backward_bytes_per_sample]
    return repeats * sum(inputs.links.seconds("all_reduce", size, layout.tp) for size in sizes)


def _model_parallel(inputs: Inputs, layout: Layout) -> Estimate:
    """pipeline, tensor, hybrid: the replica's batch goes through P stages in M
    micro-batches (bubble (p-1)/(v m + p-1)), each stage's layers split over T ranks; dp
    replicas all-reduce their gradients after the step."""
    f = inputs.calibration.figures
    dp, pp, tp = layout.dp, layout.pp, layout.tp
    replica_batch = inputs.global_batch / dp
    m = layout.microbatches if pp > 1 else 1
    micro = replica_batch / m
    s = inputs.step(micro, layout.processes_per_node)
    share, act_share, boundary, param_share = _stage_shares(inputs, layout)
    tshare = _tensor_share(inputs.tensor, tp)
    per_micro = s.compute * share * tshare
    slots = costs.pipeline_slots(pp, m, layout.virtual)
    compute = m * per_micro
    idle = (slots - m) * per_micro
    comm = _tensor_comm(inputs, layout, micro, m)
    if pp > 1:
        send = inputs.links.seconds("send_recv", boundary * micro)
        comm += 2 * send * (m * layout.virtual + pp - 1)
        comm += inputs.links.seconds("all_reduce", 8, layout.world)  # the step's loss
    states_full = f.param_bytes + f.grad_bytes + f.optimizer_bytes
    t_split = _split_param_share(inputs, tp)
    states = states_full * param_share * t_split
    if dp > 1:
        grads = f.grad_bytes * param_share * t_split
        comm += inputs.allreduce(grads, dp, layout)
        states += grads  # the replicas' reduction buffers
    held = costs.micro_batches_held(layout.schedule or "gpipe", pp, m, 0) if pp > 1 else 1
    activations = _activations(inputs, micro) * held * act_share
    data = inputs.step(replica_batch, layout.processes_per_node).data
    # The jitter of a step of the replica's whole batch (that of tiny micro-batch steps
    # overstates it: a pause of the machine costs the same time whatever the step).
    whole = inputs.step(replica_batch, layout.processes_per_node)
    wait = _wait(whole, layout.world, slots * per_micro)
    overhead = m * inputs.overhead("tensor") * share if tp > 1 else 0.0
    if dp > 1:  # replicas of stages or of DTensor layers: FSDP2's replicate
        overhead += inputs.overhead("zero2") * param_share
    return Estimate(
        layout, micro, data, compute, comm, s.optimizer * param_share * t_split, idle, states,
        activations, wait_seconds=wait, overhead_seconds=overhead,
        bubble=costs.pipeline_bubble(pp, m, layout.virtual) if pp > 1 else 0.0,
    )  # fmt: skip


def _split_param_share(inputs: Inputs, tp: int) -> float:
    """Share of the parameters one of `tp` tensor-parallel ranks holds (the plan's layers
    divided, the rest replicated); without a measured plan, all of them."""
    t = inputs.tensor
    if t is None or tp == 1:
        return 1.0
    return 1 - t.param_share * (1 - 1 / tp)


def _stage_shares(inputs: Inputs, layout: Layout) -> tuple[float, float, float, float]:
    """For the busiest pipeline rank: its share of the compute, of the activations, the
    bytes per sample at its stage boundary, and its share of the parameters. The stages
    are cut by parameter count, as dtrain cuts them (`dtrain.parallel.split.partition`)."""
    from dtrain.parallel.split import partition

    layers = inputs.calibration.figures.layers
    if layout.pp == 1 or not layers:
        return 1.0, 1.0, 0.0, 1.0
    stages = layout.pp * layout.virtual
    starts = partition([x.param_bytes or 1 for x in layers], stages)
    ends = [*starts[1:], len(layers)]
    groups = [layers[a:b] for a, b in zip(starts, ends, strict=True)]
    total_params = sum(x.param_bytes for x in layers) or 1
    ranks = []
    for r in range(layout.pp):
        mine = [g for i, g in enumerate(groups) if i % layout.pp == r]
        flat = [x for g in mine for x in g]
        ranks.append(
            (
                sum(x.time_share for x in flat),
                sum(x.activation_share for x in flat),
                max((g[-1].output_bytes_per_sample for g in mine), default=0.0),
                sum(x.param_bytes for x in flat) / total_params,
            )
        )
    busiest = max(ranks, key=lambda r: r[0])
    return (
        busiest[0],
        max(r[1] for r in ranks),
        max(r[2] for r in ranks),
        max(r[3] for r in ranks),
    )


ESTIMATORS: dict[str, Callable[[Inputs, Layout], Estimate]] = {
    "single": _single,
    "towers": _towers,
    "ddp": _data_parallel,
    "zero1": _data_parallel,
    "zero2": _sharded,
    "zero3": _sharded,
    "hsdp": _sharded,
    "ps": _parameter_server,
    "pipeline": _model_parallel,
    "tensor": _model_parallel,
    "hybrid": _model_parallel,
}


def estimate(inputs: Inputs, layout: Layout) -> Estimate:
    """The prediction for `layout`, with `fits` against the machine's memory per device."""
    result = ESTIMATORS[layout.strategy](inputs, layout)
    result.global_batch = inputs.global_batch
    result.fits = result.memory_bytes_per_rank <= inputs.machine.memory_per_device
    return result


def wrappers_of(layouts: list[Layout]) -> set[str]:
    """The torch wrappers whose own cost the calibration must time for `layouts`."""
    out = set()
    for layout in layouts:
        if layout.strategy in ("ddp", "zero1"):
            out.add("ddp")
        elif layout.strategy in ("zero2", "zero3"):
            out.add(layout.strategy)
        elif layout.strategy == "hsdp":
            out.add("zero3")
        if layout.tp > 1:
            out.add("tensor")
        if layout.strategy == "hybrid" and layout.dp > 1:
            out.add("zero2")
    return out


def probe_points(
    layouts: list[Layout], global_batch: int, machine: Machine
) -> set[tuple[int, int, bool]]:
    """(per-device batch, threads, beside other ranks) the calibration must time."""
    alone = 0 if machine.gpus else machine.single_threads
    points = set()
    for layout in layouts:
        if layout.strategy in ("single", "towers"):
            points.add((global_batch, alone, False))
            if layout.strategy == "towers":
                points.add((max(1, round(global_batch / layout.towers)), alone, False))
            continue
        threads = machine.threads(layout.processes_per_node)
        if layout.strategy in ("pipeline", "tensor", "hybrid"):
            replica = global_batch / layout.dp
            batch = replica / (layout.microbatches if layout.pp > 1 else 1)
            points.add((max(1, round(replica)), threads, True))  # its loading time
        else:
            batch = global_batch / layout.world
        points.add((max(1, round(batch)), threads, True))
    return points
