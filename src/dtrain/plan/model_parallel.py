"""The estimates of the model-parallel layouts: pipeline, tensor and hybrid.

The replica's batch goes through P stages in M micro-batches (GPipe's bubble
(p-1)/(m+p-1), interleaved 1F1B's (p-1)/(vm+p-1)), each stage's layers split over T
tensor-parallel ranks (Megatron's all-reduces); dp replicas all-reduce their gradients.
"""

from __future__ import annotations

from dtrain.plan import costs
from dtrain.plan.inputs import Estimate, Inputs, activation_bytes
from dtrain.plan.layouts import Layout
from dtrain.plan.weigh import TensorFigures


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
    return repeats * sum(inputs.collective("all_reduce", size, layout.tp, layout) for size in sizes)


def model_parallel(inputs: Inputs, layout: Layout) -> Estimate:
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
        send = inputs.stage_send(boundary * micro, layout)
        comm += 2 * send * (m * layout.virtual + pp - 1)
        # The step's loss, from the last stage to the others.
        comm += inputs.collective("broadcast", 8, pp, layout, stride=layout.dp * layout.tp)
    states_full = f.param_bytes + f.grad_bytes + f.optimizer_bytes
    t_split = _split_param_share(inputs, tp)
    states = states_full * param_share * t_split
    buffers = 0.0
    if dp > 1:
        grads = f.grad_bytes * param_share * t_split
        comm += inputs.allreduce(grads, dp, layout, stride=tp)
        buffers = grads  # the replicas' reduction buffers
    held = costs.micro_batches_held(layout.schedule or "gpipe", pp, m, 0) if pp > 1 else 1
    saved = activation_bytes(inputs, micro) * held * act_share
    data = inputs.step(replica_batch, layout.processes_per_node).data
    lost = inputs.jitter_wait(layout.world, slots * per_micro)
    overhead = m * inputs.overhead("tensor") * share if tp > 1 else 0.0
    if pp > 1:  # the schedule's own work for each of its v x m micro-batch passes
        overhead += layout.virtual * m * inputs.overhead("pipeline")
    if dp > 1:  # replicas of stages or of DTensor layers: FSDP2's replicate
        overhead += inputs.overhead("zero2") * param_share
    return Estimate(
        layout, micro, data, compute, comm, s.optimizer * param_share * t_split, idle, states,
        saved, wait_seconds=lost, overhead_seconds=overhead, buffer_bytes=buffers,
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
    last = len(groups) - 1  # its output (the logits) goes to the loss, never to a stage
    total_params = sum(x.param_bytes for x in layers) or 1
    ranks = []
    for r in range(layout.pp):
        mine = [i for i in range(len(groups)) if i % layout.pp == r]
        flat = [x for i in mine for x in groups[i]]
        ranks.append(
            (
                sum(x.time_share for x in flat),
                sum(x.activation_share for x in flat),
                max((groups[i][-1].output_bytes_per_sample for i in mine if i < last), default=0.0),
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
