"""What the model weighs, measured once: bytes, FLOPs, its FSDP units, the share of each
layer of its pipeline chain and of its tensor-parallel plan, and its experts.

- bytes: parameters, gradients (fp32, as dtrain trains by default), the optimizer's state
  after one real step of the chosen optimizer, and the activations autograd saves for
  backward per sample (counted as they are saved, storages once, weights excluded);
- per layer of the pipeline chain: its share of the forward time, of the saved
  activations, and its output's bytes (what a stage boundary sends);
- the tensor-parallel plan: its layers' share of the time and of the parameters, and the
  activations each one all-reduces;
- the experts modules (`dtrain.parallel.expert_parallel.experts_of`): their parameter
  bytes, and the bytes of the rows each MoE layer routes per sample (what --ep sends to
  the experts' ranks), read off the forward that measures the activations;
- FLOPs per sample (`torch.utils.flop_counter.FlopCounterMode`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from dtrain.models.recipes import make_optimizer
from dtrain.plan.source import Workload


def sync(device: torch.device) -> None:
    """Wait for `device` to finish (calibration only: never on a training step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LayerFigures:
    """One layer of the model's pipeline chain."""

    name: str
    param_bytes: int
    time_share: float
    """Its share of the model's forward time."""
    activation_share: float
    """Its share of the activation bytes saved for backward."""
    output_bytes_per_sample: float
    """Bytes of its output per sample (sent forward at a stage boundary)."""


@dataclass
class ModelFigures:
    """What the model weighs, measured once."""

    params: int
    param_tensors: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: float
    flops_per_sample: float | None
    tensor_bytes: list[int]
    """Bytes of each parameter tensor (zero1 broadcasts them one by one)."""
    unit_bytes: list[int]
    """Parameter bytes of each FSDP unit: the repeated blocks in order, then the root
    (what is left); each unit is one all-gather and one reduce-scatter."""
    layers: list[LayerFigures] | None = None
    """The pipeline chain, or None when the model has none."""
    tensor_shapes: list[tuple[int, ...]] = field(default_factory=list)
    """The shape of each parameter tensor (PowerSGD compresses the matrices among them)."""
    buffer_bytes: int = 0
    """Bytes of the floating-point buffers (BatchNorm's running statistics), which a
    local-sgd sync averages with the parameters."""
    expert_bytes: int = 0
    """Trainable parameter bytes of the experts modules (`experts_of`); 0 for a dense
    model."""
    moe_layers: int = 0
    """How many experts modules (mixture-of-experts layers) the model has."""
    routed_bytes_per_sample: float = 0.0
    """Bytes of the rows one MoE layer routes per sample (tokens x top-k rows of its
    width), averaged over the layers: what --ep's all-to-alls send each way."""


def weigh(work: Workload, model: nn.Module, device: torch.device, batch: int) -> ModelFigures:
    """Bytes, FLOPs, blocks, the per-layer figures and the experts' figures of `model`."""
    from dtrain.parallel.blocks import find_blocks
    from dtrain.parallel.expert_parallel import experts_of

    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = make_optimizer(work.optimizer, model, 1e-12)
    inputs, targets = work.batch(batch, device)
    work.loss_fn(model(inputs), targets).backward()
    optimizer.step()
    optimizer_bytes = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    optimizer.zero_grad(set_to_none=True)
    blocks = [
        sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
        for b in find_blocks(model)
    ]
    layers = _chain(model)
    experts = list(experts_of(model).values())
    routed: list[float] = []
    handles = [m.register_forward_hook(_count_routed(routed), with_kwargs=True) for m in experts]
    try:
        saved, per_layer, outputs, times = _forward_figures(work, model, layers, batch, device)
    finally:
        for h in handles:
            h.remove()
    expert_params = {id(p): p for m in experts for p in m.parameters() if p.requires_grad}
    total_time = sum(times) or 1.0
    total_saved = sum(per_layer) or 1.0
    chain = None
    if layers is not None:
        chain = [
            LayerFigures(
                name,
                sum(p.numel() * p.element_size() for p in layer.parameters()),
                times[i] / total_time,
                per_layer[i] / total_saved,
                outputs[i] / batch,
            )
            for i, (name, layer) in enumerate(layers)
        ]
    return ModelFigures(
        params=sum(p.numel() for p in params),
        param_tensors=len(params),
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes_per_sample=saved / batch,
        flops_per_sample=_flops_per_sample(work, model, device),
        tensor_bytes=[p.numel() * p.element_size() for p in params],
        unit_bytes=[*blocks, param_bytes - sum(blocks)],
        layers=chain,
        tensor_shapes=[tuple(p.shape) for p in params],
        buffer_bytes=sum(
            b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point()
        ),
        expert_bytes=sum(p.numel() * p.element_size() for p in expert_params.values()),
        moe_layers=len(experts),
        routed_bytes_per_sample=sum(routed) / max(len(routed), 1) / batch,
    )


def _count_routed(routed: list[float]) -> Callable[..., None]:
    """A forward hook (with kwargs) for an experts module, called as ``experts(hidden
    (T, dim), top_k_index (T, K), top_k_weights)``: appends to `routed` the bytes of the
    rows it was sent, T x K rows of dim values."""

    def hook(
        _m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], _out: object
    ) -> None:
        hidden, index = [*args, *kwargs.values()][:2]
        assert isinstance(hidden, torch.Tensor) and isinstance(index, torch.Tensor)
        routed.append(index.numel() * hidden.shape[-1] * hidden.element_size())

    return hook


def _chain(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    from dtrain.errors import ConfigError
    from dtrain.parallel.split import layers_of

    try:
        return layers_of(model)
    except ConfigError:
        return None


def _forward_figures(
    work: Workload,
    model: nn.Module,
    layers: list[tuple[str, nn.Module]] | None,
    batch: int,
    device: torch.device,
) -> tuple[int, list[float], list[float], list[float]]:
    """(activation bytes saved in all, saved per layer, output bytes per layer, forward
    seconds per layer) of one forward at `batch` samples."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    count = max(len(layers or ()), 1)
    per_layer = [0.0] * count
    outputs = [0.0] * count
    times = [0.0] * count
    current = [0]
    began = [0.0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in seen:
            seen.add(key)
            per_layer[current[0]] += storage.nbytes()
        return t

    def before(i: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            current[0] = i
            sync(device)
            began[0] = time.perf_counter()

        return hook

    def after(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _in: object, out: object) -> None:
            sync(device)
            times[i] += time.perf_counter() - began[0]
            if isinstance(out, torch.Tensor):
                outputs[i] += out.numel() * out.element_size()

        return hook

    handles = []
    for i, (_, layer) in enumerate(layers or ()):
        handles.append(layer.register_forward_pre_hook(before(i)))
        handles.append(layer.register_forward_hook(after(i)))
    inputs, targets = work.batch(batch, device)
    try:
        for _ in range(2):  # the second pass is timed warm
            per_layer = [0.0] * count
            outputs = [0.0] * count
            times = [0.0] * count
            seen.clear()
            with saved_tensors_hooks(pack, lambda t: t):
                loss = work.loss_fn(model(inputs), targets)
            del loss
    finally:
        for h in handles:
            h.remove()
    return int(sum(per_layer)), per_layer, outputs, times


def _flops_per_sample(work: Workload, model: nn.Module, device: torch.device) -> float | None:
    """Forward + backward FLOPs of one sample (None where torch cannot count them)."""
    inputs, targets = work.batch(2, device)
    try:
        with FlopCounterMode(display=False) as counter:
            work.loss_fn(model(inputs), targets).backward()
    except Exception:  # an operator the counter does not know: report no FLOPs
        return None
    finally:
        model.zero_grad(set_to_none=True)
    total = counter.get_total_flops()
    return total / 2 if total else None


@dataclass
class TensorFigures:
    """What the model's tensor-parallel plan splits, measured at one forward."""

    time_share: float
    """Share of the forward time spent in the layers the plan splits."""
    forward_bytes_per_sample: list[float]
    """Per row-split layer: its output per sample (all-reduced in forward)."""
    backward_bytes_per_sample: list[float]
    """Per column-split layer: its input per sample (its gradient all-reduced in backward)."""
    param_share: float
    """Share of the parameters in the layers the plan splits."""


def tensor_figures(work: Workload, batch: int, device: torch.device) -> TensorFigures | None:
    """The figures of the model's tensor-parallel plan, or None when it has none."""
    from fnmatch import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dtrain.errors import ConfigError
    from dtrain.parallel.tensor_plan import plan_of

    model = work.model
    try:
        plan = plan_of(model, 1)
    except ConfigError:
        return None
    inputs, targets = work.batch(batch, device)
    model = copy.deepcopy(model).to(device)
    forward_bytes: list[float] = []
    backward_bytes: list[float] = []
    split_time = [0.0]
    began = [0.0]
    handles = []
    split_params = 0
    for name, module in model.named_modules():
        style = next((s for path, s in plan.items() if fnmatch(name, path)), None)
        if style is None:
            continue
        split_params += sum(p.numel() for p in module.parameters())

        def pre(_m: nn.Module, _args: object) -> None:
            sync(device)
            began[0] = time.perf_counter()

        def post(
            _m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, style: object = style
        ) -> None:
            sync(device)
            split_time[0] += time.perf_counter() - began[0]
            if isinstance(style, RowwiseParallel):
                forward_bytes.append(out.numel() * out.element_size() / batch)
            elif isinstance(style, ColwiseParallel):
                backward_bytes.append(args[0].numel() * args[0].element_size() / batch)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(inputs)  # warm-up
            forward_bytes.clear()
            backward_bytes.clear()
            split_time[0] = 0.0
            sync(device)
            t0 = time.perf_counter()
            model(inputs)
            sync(device)
            whole = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    del targets
    total = sum(p.numel() for p in model.parameters()) or 1
    return TensorFigures(
        min(1.0, split_time[0] / max(whole, 1e-12)),
        forward_bytes,
        backward_bytes,
        split_params / total,
    )
