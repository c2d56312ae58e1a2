"""Horovod's helpers built on the collectives: `broadcast_parameters`,
`broadcast_optimizer_state`, `broadcast_object` and `allgather_object`."""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dtrain.horovod import basics
from dtrain.horovod.allgather import start as start_allgather
from dtrain.horovod.broadcast import start as start_broadcast
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet, global_process_set

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle  # type: ignore[assignment]


def _tensors_of(params: object) -> list[tuple[str | None, torch.Tensor]]:
    """(name, tensor) pairs in an order every process agrees on."""
    if isinstance(params, Mapping):
        pairs = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        pairs = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise HorovodUsageError(
            f"hvd.broadcast_parameters takes a state_dict, a list of (name, tensor) pairs or "
            f"a list of tensors, got {type(params).__name__}; pass model.state_dict() or "
            "list(model.named_parameters())."
        )
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise HorovodUsageError(
                f"hvd.broadcast_parameters: {name or 'an entry'} is a {type(t).__name__}, not a "
                "tensor; pass only tensors (model.state_dict() holds only tensors)."
            )
    return [(None if n is None else str(n), t) for n, t in pairs]


def _broadcast_fused(tensors: list[torch.Tensor], root_rank: int, what: str) -> None:
    """Overwrite `tensors` with root's, one collective per dtype and device type (the
    buckets must line up on every process, so they never depend on a device index)."""
    buckets: dict[tuple[torch.dtype, str], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device.type), []).append(t)
    pending: list[tuple[list[torch.Tensor], Operation]] = []
    with torch.no_grad():
        for members in buckets.values():
            home = members[0].device
            flat = torch.cat([t.detach().reshape(-1).to(home) for t in members])
            pending.append((members, start_broadcast(flat, root_rank, what, None)))
        for members, handle in pending:
            flat, offset = handle.wait(), 0
            for t in members:
                n = t.numel()
                t.detach().copy_(flat[offset : offset + n].view(t.shape))
                offset += n


def broadcast_parameters(params: object, root_rank: int) -> None:
    """Overwrite every process's parameters with `root_rank`'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` (or a list of
            (name, tensor) pairs), or a list of tensors; the same structure on every process.
        root_rank: the process whose values everyone takes.
    """
    basics.context("broadcast_parameters")
    pairs = _tensors_of(params)
    _broadcast_fused([t for _, t in pairs], root_rank, "broadcast_parameters")


def broadcast_object(
    obj: Any = None,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """`root_rank`'s `obj`, pickled there and returned on every member of `process_set`
    (root gets its own object back). Unnamed, the two broadcasts it takes get automatic
    names (Horovod names them after the object's type, which differs between a root holding
    an object and the others passing None)."""
    ctx = basics.context("broadcast_object")
    if ctx.rank == root_rank:
        payload = torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    what = "broadcast_object"
    start_broadcast(length, root_rank, what, name and f"{name}.size", process_set).wait()
    if ctx.rank != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    start_broadcast(payload, root_rank, what, name and f"{name}.bytes", process_set).wait()
    return obj if ctx.rank == root_rank else pickle.loads(payload.numpy().tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every member's `obj`, in rank order (each pickled where it lives). Unnamed, the
    gather is named after the object's type, as in Horovod: the same name on every
    process whatever operations each ran before (an automatic counter would drift on a
    process whose earlier operation was refused)."""
    basics.context("allgather_object")
    payload = torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)
    name = name or f"allgather_object.{type(obj).__name__}"
    gathered, rows = start_allgather([payload], "allgather_object", name, process_set).wait()
    gathered = gathered[0]
    objects, offset = [], 0
    for n in rows[0]:
        objects.append(pickle.loads(gathered[offset : offset + n].numpy().tobytes()))
        offset += n
    return objects


def _describe_state(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Root's optimizer state with every tensor replaced by ("tensor", shape, dtype,
    device type)."""
    return {
        index: {
            key: ("tensor", tuple(v.shape), v.dtype, v.device.type)
            if isinstance(v, torch.Tensor)
            else ("value", v)
            for key, v in entry.items()
        }
        for index, entry in state.items()
    }


def _local_device(device_type: str) -> torch.device:
    """This process's device of `device_type` (its current GPU for "cuda")."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    """ids of the parameters of `model`'s sparse embeddings (their gradients are sparse)."""
    if model is None:
        return set()
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()
    }


def _zero_missing_gradients(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
) -> None:
    """Give every parameter of an optimizer without state that requires a gradient and has
    none a zero one (sparse for `SparseAdam` and for `model`'s sparse embeddings under SGD),
    as Horovod leaves them. Horovod then steps on them to create the state; no step is
    taken here (see `broadcast_optimizer_state`)."""
    if optimizer.state:
        return
    sparse = _sparse_parameters(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or p.grad is not None:
                continue
            grad = torch.zeros_like(p)
            sparse_grad = isinstance(optimizer, torch.optim.SparseAdam) or (
                isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
            )
            p.grad = grad.to_sparse() if sparse_grad else grad


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Give every process `root_rank`'s optimizer state and hyperparameters (learning
    rate, momentum, ... of every parameter group).

    Root first announces the layout of its state (keys, shapes, dtypes, and the values
    that are not tensors); the other processes make room for it, the tensors follow in
    fused broadcasts, and the others load the result with ``load_state_dict``. No
    optimizer step is taken and no parameter changes; an optimizer that has not stepped
    yet on root leaves every process with a fresh one carrying root's hyperparameters.
    Horovod instead steps a fresh optimizer on zero gradients, which applies weight decay
    and counts a step for Adam, so the model would no longer equal one trained by one
    process; the zero gradients it leaves are left here too, on the parameters that
    require one and have none (`model`, if given, marks its sparse embeddings, whose zero
    gradients are sparse, as Horovod's `model` argument does).
    """
    ctx = basics.context("broadcast_optimizer_state")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise HorovodUsageError(
            f"hvd.broadcast_optimizer_state takes a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass the optimizer itself."
        )
    _zero_missing_gradients(optimizer, model)
    mine = optimizer.state_dict()
    layout = (
        (_describe_state(mine["state"]), mine["param_groups"]) if ctx.rank == root_rank else None
    )
    described, groups = broadcast_object(layout, root_rank, "optimizer.layout")
    received: dict[int, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    for index in sorted(described):
        received[index] = {}
        for key in sorted(described[index], key=str):
            kind, *rest = described[index][key]
            if kind == "value":
                received[index][key] = rest[0]
                continue
            if ctx.rank == root_rank:
                tensor = mine["state"][index][key]
            else:
                shape, dtype, device_type = rest
                tensor = torch.empty(shape, dtype=dtype, device=_local_device(device_type))
            received[index][key] = tensor
            tensors.append(tensor)
    _broadcast_fused(tensors, root_rank, "broadcast_optimizer_state")
    if ctx.rank == root_rank:
        return
    try:
        optimizer.load_state_dict({"state": received, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise HorovodUsageError(
            f"hvd.broadcast_optimizer_state: rank {ctx.rank}'s optimizer does not fit rank "
            f"{root_rank}'s state ({e}); build the same model and optimizer, with the same "
            "parameter groups, on every process."
        ) from None
