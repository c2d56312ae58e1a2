"""Predicted step time and memory of one layout, from the calibration and the formulas.

Per step, t1 is the compute (forward + backward at the per-device batch, measured) and t2
the communication that compute does not hide; the step is t1 + t2 + the optimizer (+ the
pipeline's idle fill and drain). Each strategy's terms are in its function below; the
formulas themselves are in `dtrain.plan.costs` and docs/plan.md.

The ranking (`rank`) keeps the promise of the same training first: the exact layouts and
the rounded ones (a 16-bit --grad-compression: the same training within the format's
rounding, `Layout.training`) compete on predicted speed, a rounded one only just behind
an exact one in a near tie; the approximate ones (PowerSGD, local SGD, DiLoCo: their loss
can differ) come after all of them, however much faster they are predicted.
"""

from __future__ import annotations

from collections.abc import Callable

from dtrain.config import grad_compression
from dtrain.plan import costs
from dtrain.plan.calibrate import StepTime
from dtrain.plan.inputs import Estimate, Inputs, activation_bytes, overlapped
from dtrain.plan.layouts import Layout
from dtrain.plan.machine import Machine
from dtrain.plan.model_parallel import model_parallel

__all__ = ["Estimate", "Inputs", "estimate", "probe_points", "rank", "wrappers_of"]

ROUNDED_PREFERENCE = 1.03
"""A rounded layout ranks above an exact one only when predicted more than this many times
as fast: in a near tie the layout without the cast wins, as it trains `single`'s model to
the last bit."""
INEXACT_SHARE = 0.25
"""On one machine the inexact layouts are offered only where exact ddp spends at least
this share of its step communicating; elsewhere they change the training for little."""
DENSE_FLOPS_PER_PARAMETER = 6
"""Forward + backward FLOPs per parameter per sample of a dense model (2 forward, 4
backward): PowerSGD's compute rate where FlopCounterMode counts none."""
POWERSGD_SLOWDOWN = 4.0
"""PowerSGD's small matmuls, its column-by-column Gram-Schmidt (a Python loop in torch's
hook) and its copies in and out of the buckets run well below the model's own FLOP rate:
its FLOPs are counted at a quarter of that rate (a rough factor, not measured)."""


def _single(inputs: Inputs, layout: Layout) -> Estimate:
    f = inputs.calibration.figures
    s = inputs.single_step(inputs.global_batch)
    states = costs.zero_model_states(f.param_bytes, f.grad_bytes, f.optimizer_bytes, 1, 0, False)
    return Estimate(
        layout, inputs.global_batch, s.data, s.compute, 0.0, s.optimizer, 0.0, states,
        activation_bytes(inputs, inputs.global_batch),
        wait_seconds=inputs.jitter_wait(1, s.compute, shared=False),
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
        compute, copies, lost = part.compute, t, inputs.jitter_wait(t, part.compute, False)
    else:
        compute, copies = t * part.compute, t - 1
        lost = inputs.jitter_wait(1, compute, shared=False)
    moved = costs.towers_replication_bytes(f.param_bytes, copies)
    whole = inputs.single_step(inputs.global_batch)
    states = f.param_bytes + f.grad_bytes + f.optimizer_bytes
    return Estimate(
        layout, b, whole.data, compute, moved / inputs.calibration.copy_bandwidth,
        whole.optimizer, 0.0, states, activation_bytes(inputs, inputs.global_batch),
        wait_seconds=lost, buffer_bytes=moved,  # each copy's parameters and gradients
    )  # fmt: skip


def _data_parallel(inputs: Inputs, layout: Layout) -> Estimate:
    """ddp, zero1: DDP's bucketed all-reduce overlapped with backward; zero1 adds the
    broadcast of every parameter from the rank that updated it and updates 1/N.
    --grad-compression fp16/bf16 halves the all-reduced bytes (under --hierarchical those
    between machines); PowerSGD all-reduces `costs.powersgd_values` in three all-reduces
    a bucket (the values sent whole, then the P and the Q factors) and computes its
    factors (`_powersgd_seconds`). Under --ep DDP holds and buckets only the parameters
    outside the experts; the experts' states are held at 1/ep (`_expert_states`), their
    share of the optimizer step runs at 1/ep, their traffic is `_experts`."""
    f = inputs.calibration.figures
    n = layout.world
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node, layout.cp)
    kind, rank = grad_compression(layout.grad_compression)
    split = _expert_share(inputs, layout)
    dense = 1 - split
    sizes = costs.ddp_buckets(dense * f.grad_bytes)
    extra = buffers = 0.0
    if kind == "powersgd":
        value = f.grad_bytes / max(f.params, 1)
        ratio = costs.powersgd_values(f.tensor_shapes, rank) * value / max(f.grad_bytes, 1)
        latency = inputs.allreduce(0, n, layout)
        buckets = [inputs.allreduce(ratio * size, n, layout) + 2 * latency for size in sizes]
        extra = _powersgd_seconds(inputs, s, b, rank)
        # Error feedback keeps each compressed matrix's error, warm start its Q.
        matrices = costs.powersgd_matrices(f.tensor_shapes, rank)
        buffers = value * sum(m * c + c * r for m, c, r in matrices)
    else:
        cast = costs.cast_bytes_factor(kind)
        buckets = [inputs.allreduce(size, n, layout, cast=cast) for size in sizes]
    comm = overlapped(inputs, layout, buckets, s.backward) + _context(inputs, layout, b)
    comm += _experts(inputs, layout, b)
    optimizer = s.optimizer * (dense + split / layout.ep)
    stage = 0
    if layout.strategy == "zero1":
        stage = 1
        optimizer /= n
        comm += sum(inputs.collective("broadcast", size, n, layout) for size in f.tensor_bytes)
    states = costs.zero_model_states(
        dense * f.param_bytes, dense * f.grad_bytes, dense * f.optimizer_bytes, n, stage, False
    ) + _expert_states(inputs, layout)
    if stage == 1:  # whole tensors per rank: the fullest holds more than 1/N of the state
        share = costs.greedy_partition_share([float(x) for x in f.tensor_bytes], n)
        states += f.optimizer_bytes * (share - 1 / n)
    return Estimate(
        layout, b, s.data, s.compute, comm, optimizer, 0.0, states, activation_bytes(inputs, b),
        wait_seconds=inputs.jitter_wait(n, s.compute),
        overhead_seconds=inputs.overhead("ddp") + extra,
        buffer_bytes=dense * f.grad_bytes + buffers,  # DDP's buckets at the peak of backward
    )  # fmt: skip


def _powersgd_seconds(inputs: Inputs, s: StepTime, batch: float, rank: int) -> float:
    """PowerSGD's own compute per step: `costs.powersgd_flops` at the FLOP rate the
    device reaches on the model (its FLOPs per sample x `batch` in the measured forward
    and backward), slowed by `POWERSGD_SLOWDOWN`."""
    f = inputs.calibration.figures
    per_sample = f.flops_per_sample or DENSE_FLOPS_PER_PARAMETER * f.params
    rate = per_sample * batch / max(s.compute, 1e-12)
    return POWERSGD_SLOWDOWN * costs.powersgd_flops(f.tensor_shapes, rank) / rate


def _sharded(inputs: Inputs, layout: Layout) -> Estimate:
    """zero2, zero3, hsdp (FSDP2, unit by unit): forward all-gathers each unit (prefetched
    during the previous unit's forward); backward reduce-scatters each unit's gradients
    (and zero3 all-gathers the unit again first: 1.5x the traffic). hsdp's fp16/bf16
    --grad-compression is FSDP2's reduce dtype: every gradient reduction sends half. Under
    --ep FSDP2 gathers, scatters and shards only the parameters outside the experts (each
    unit's bytes scaled by their share); the experts' states are held at 1/ep
    (`_expert_states`), their share of the optimizer step runs at 1/ep, their traffic is
    `_experts`."""
    f = inputs.calibration.figures
    cast = costs.cast_bytes_factor(layout.grad_compression)
    n = layout.world
    shard = layout.shard_size or n
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node, layout.cp)
    stage = 2 if layout.strategy == "zero2" else 3

    def gather(size: float) -> float:
        return inputs.collective("all_gather", size, shard, layout)

    def scatter(size: float) -> float:
        seconds = inputs.collective("reduce_scatter", cast * size, shard, layout)
        if shard < n:  # hsdp: each shard's gradients are averaged across the replicas
            seconds += inputs.allreduce(size / shard, n // shard, layout, shard, cast)
        return seconds

    split = _expert_share(inputs, layout)
    dense = 1 - split
    units = [dense * u for u in f.unit_bytes]
    forward = [gather(u) for u in units]
    backward = [(gather(u) if stage == 3 else 0.0) + scatter(u) for u in reversed(units)]
    comm = forward[0] + overlapped(inputs, layout, forward[1:], s.forward)
    comm += overlapped(inputs, layout, backward, s.backward) + _context(inputs, layout, b)
    comm += _experts(inputs, layout, b)
    states = costs.zero_model_states(
        dense * f.param_bytes, dense * f.grad_bytes, dense * f.optimizer_bytes, shard, stage
    ) + _expert_states(inputs, layout)
    optimizer = s.optimizer * (dense / shard + split / layout.ep)
    return Estimate(
        layout, b, s.data, s.compute, comm, optimizer, 0.0, states,
        activation_bytes(inputs, b), wait_seconds=inputs.jitter_wait(n, s.compute),
        overhead_seconds=inputs.overhead("zero2" if stage == 2 else "zero3"),
    )  # fmt: skip


def _context(inputs: Inputs, layout: Layout, batch: float) -> float:
    """--cp's communication in a step, none of it hidden (each block's attention waits for
    its keys and values): every block's keys and values (`costs.context_kv_messages`, the
    whole samples' that this rank's `batch` of samples' worth of tokens belong to)
    all-gathered over the context ranks in forward and again in backward, and their
    gradients reduce-scattered. The data-parallel and context-parallel ranks average their
    gradients together, as the strategy's own terms count them at `layout.world`."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    f = inputs.calibration.figures
    whole = activation_bytes(inputs, batch * cp)
    return sum(
        2 * inputs.collective("all_gather", size, cp, layout)
        + inputs.collective("reduce_scatter", size, cp, layout)
        for size in costs.context_kv_messages(whole, len(f.unit_bytes))
    )


def _expert_share(inputs: Inputs, layout: Layout) -> float:
    """The share of the parameters that --ep takes from the data-parallel wrapper (the
    experts', `costs.expert_share`); 0 without --ep."""
    f = inputs.calibration.figures
    return costs.expert_share(f.expert_bytes, f.param_bytes) if layout.ep > 1 else 0.0


def _expert_states(inputs: Inputs, layout: Layout) -> float:
    """The experts' model states per rank under --ep, at 1/ep (`costs.expert_model_states`;
    0 without --ep)."""
    f = inputs.calibration.figures
    share = _expert_share(inputs, layout)
    return costs.expert_model_states(
        f.param_bytes, f.grad_bytes, f.optimizer_bytes, share, layout.ep
    )


def _experts(inputs: Inputs, layout: Layout, batch: float) -> float:
    """--ep's communication in a step, none of it hidden (each MoE layer waits for its
    rows): per MoE layer, one all-to-all of the experts' counts (its latency) and
    `costs.EXPERT_ALL_TO_ALLS` all-to-alls of the rows this rank's `batch` samples route,
    over the ep ranks (each priced as an all-gather of as many bytes: every rank sends
    them all, its own experts' share to itself); then, after backward, the experts'
    gradients (1/ep of them per rank) all-reduced over the world / ep ranks holding the
    same experts, ep apart (none when ep is the world)."""
    ep = layout.ep
    if ep == 1:
        return 0.0
    f = inputs.calibration.figures
    rows = inputs.collective("all_gather", f.routed_bytes_per_sample * batch, ep, layout)
    counts = inputs.collective("all_gather", 0, ep, layout)
    seconds = f.moe_layers * (counts + costs.EXPERT_ALL_TO_ALLS * rows)
    replicas = layout.world // ep
    if replicas > 1:
        seconds += inputs.allreduce(f.expert_bytes / ep, replicas, layout, stride=ep)
    return seconds


def _local_sgd(inputs: Inputs, layout: Layout) -> Estimate:
    """local-sgd: each replica computes its share of the batch and steps alone; every H-th
    step the replicas all-reduce their parameters and floating-point buffers in one flat
    message (DiLoCo: the parameters' changes, the same bytes) that no compute hides, so
    t2 = sync / H (`costs.local_sgd_seconds`). DiLoCo's outer step and the changes (a few
    passes over the parameters every H steps) are not counted; DiLoCo holds the synced
    model, and an outer optimizer with momentum its buffer."""
    f = inputs.calibration.figures
    n = layout.world
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node)
    synced = f.param_bytes + f.buffer_bytes
    comm = costs.local_sgd_seconds(inputs.allreduce(synced, n, layout), layout.sync_every)
    states = f.param_bytes + f.grad_bytes + f.optimizer_bytes
    if layout.outer_optimizer != "none":
        states += f.param_bytes * (2 if layout.outer_optimizer == "nesterov" else 1)
    return Estimate(
        layout, b, s.data, s.compute, comm, s.optimizer, 0.0, states, activation_bytes(inputs, b),
        wait_seconds=inputs.jitter_wait(n, s.compute),
        buffer_bytes=synced,  # the flat copy a sync all-reduces
    )  # fmt: skip


def _parameter_server(inputs: Inputs, layout: Layout) -> Estimate:
    """Workers push gradients and pull parameters through the servers (PS formula on the
    measured send/recv bandwidth, plus one round trip's latency); each server updates its
    1/K of the model, on the critical path of a synchronous step. On the CPU the K server
    processes share the machine's cores with the N workers (`Inputs.crowd`)."""
    f = inputs.calibration.figures
    n, k = layout.nproc, layout.servers
    b = inputs.global_batch / n
    s = inputs.step(b, layout.processes_per_node)
    bandwidth = inputs.links.p2p_bandwidth
    comm = costs.ps_step_seconds(f.param_bytes, n, k, bandwidth)
    comm += 2 * inputs.local("send_recv", 0)
    states = f.param_bytes + f.grad_bytes
    return Estimate(
        layout, b, s.data, s.compute, comm, s.optimizer / k, 0.0, states,
        activation_bytes(inputs, b), wait_seconds=inputs.jitter_wait(n, s.compute),
    )  # fmt: skip


ESTIMATORS: dict[str, Callable[[Inputs, Layout], Estimate]] = {
    "single": _single,
    "towers": _towers,
    "ddp": _data_parallel,
    "zero1": _data_parallel,
    "zero2": _sharded,
    "zero3": _sharded,
    "hsdp": _sharded,
    "ps": _parameter_server,
    "local-sgd": _local_sgd,
    "pipeline": model_parallel,
    "tensor": model_parallel,
    "hybrid": model_parallel,
}


def estimate(inputs: Inputs, layout: Layout) -> Estimate:
    """The prediction for `layout`, with `fits` against the machine's memory per device.

    Every layout's process also does the Engine's own work each step (measured once, the
    same on every rank); on the CPU, processes that want more threads than there are
    cores stretch every term (`Inputs.crowd`)."""
    result = ESTIMATORS[layout.strategy](inputs, layout)
    result.overhead_seconds += inputs.calibration.engine_seconds
    result.crowded(inputs.crowd(layout))
    result.global_batch = inputs.global_batch
    result.fits = result.memory_bytes_per_rank <= inputs.machine.memory_per_device
    return result


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """`estimates` best first: the layouts that keep the training (exact and rounded) by
    predicted samples per second, a rounded one's divided by `ROUNDED_PREFERENCE`; then the
    approximate ones by samples per second. An approximate layout never ranks above one
    that keeps the training: on slow links local SGD is predicted many times as fast, but
    its loss can be several percent worse (docs/benchmarks.md, "Slow links"), and a
    prediction cannot weigh speed against loss."""

    def key(e: Estimate) -> tuple[bool, float]:
        training = e.layout.training
        preference = ROUNDED_PREFERENCE if training == "rounded" else 1.0
        return training == "approximate", -e.samples_per_second / preference

    return sorted(estimates, key=key)


def inexact_unneeded(estimates: list[Estimate]) -> str | None:
    """Why the inexact layouts are not offered on one machine: exact ddp spends less than
    `INEXACT_SHARE` of its step communicating (None if it spends more, or did not fit)."""
    ddp = [e for e in estimates if e.layout.strategy == "ddp" and e.layout.exact]
    if not ddp:
        return None
    share = ddp[0].communication_seconds / ddp[0].step_seconds
    if share >= INEXACT_SHARE:
        return None
    return (
        f"ddp communicates {share:.0%} of its step on this machine's links (under "
        f"{INEXACT_SHARE:.0%}), so 16-bit gradients, PowerSGD and local SGD would round or "
        "change the training for little speed; they are offered across machines, or where "
        "the links are slow."
    )


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
        if layout.pp > 1:
            out.add("pipeline")
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
            batch = global_batch / layout.data_parallel  # whole samples (cut under --cp)
        points.add((max(1, round(batch)), threads, True))
    return points
