"""The gradient side of `hvd.DistributedOptimizer`: a post-accumulate-grad hook per
parameter that starts its all-reduce as soon as backward has accumulated it
`backward_passes_per_step` times, so communication overlaps the rest of backward.

Each gradient is reduced under its parameter's name (``allreduce.<name from
named_parameters>``, or ``allreduce.noname.<index>`` without them), so processes match
them by name whatever order backward produces them in; a parameter without a gradient on
some process is reduced with zeros at `synchronize()`, as in Horovod. `groups` fuses the
gradients of each group into one operation once all of them are ready.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dtrain.horovod import basics
from dtrain.horovod.allgather import start_sparse
from dtrain.horovod.allreduce import start
from dtrain.horovod.compression import Compressor
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle
from dtrain.horovod.negotiation import Operation
from dtrain.horovod.process_sets import ProcessSet
from dtrain.horovod.reduction import ReduceOp

Key = torch.Tensor | tuple[torch.Tensor, ...]
WHAT = "DistributedOptimizer"


class GradientReducer:
    """Per-parameter hooks and the all-reduces they start, for one optimizer.

    Args:
        params: the optimizer's parameters (those requiring a gradient get a hook).
        named_parameters: (name, parameter) pairs naming them, or None.
        compression, op, predivide, sparse_as_dense, process_set: as DistributedOptimizer.
        passes: backward passes accumulated locally before each all-reduce.
        groups: fusion groups (a count, or lists of parameters), or None.
        included: whether this process is in `process_set` (outside it nothing is reduced).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        op: ReduceOp,
        predivide: float,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        passes: int,
        groups: int | Sequence[Sequence[torch.Tensor]] | None,
        included: bool = True,
    ) -> None:
        self.names = _names(named_parameters, params)
        self.compression, self.op, self.predivide = compression, op, predivide
        self.sparse_as_dense, self.process_set = sparse_as_dense, process_set
        self.passes = passes
        self.params: list[torch.Tensor] = []
        self.delay: dict[torch.Tensor, int] = {}
        self.handles: dict[Key, tuple[Operation | Handle, Any]] = {}
        self.group_of: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}
        self.ready: dict[tuple[torch.Tensor, ...], int] = {}
        self.hooks: list[Any] = []
        # As in Horovod, one process needs no hooks (there is nothing to reduce), and a
        # process outside the set keeps its own gradients.
        self.reduces = included and basics.size() > 1
        self.track(params)
        if groups is not None:
            for group in _groups(groups, self.params):
                self.ready[group] = 0
                for p in group:
                    self.group_of[p] = group

    def track(self, params: list[torch.Tensor]) -> None:
        """Reduce the gradients of `params` (those that require one) from now on."""
        ref = weakref.ref(self)
        for p in params:
            if not p.requires_grad or p in self.delay:
                continue
            self.names.setdefault(p, f"allreduce.noname.{len(self.names)}")
            self.params.append(p)
            self.delay[p] = self.passes
            if self.reduces:
                self.hooks.append(p.register_post_accumulate_grad_hook(_forward_to(ref)))

    def gradient_ready(self, p: torch.Tensor) -> None:
        """The hook: count one accumulation of `p`'s gradient; start its all-reduce (or
        its group's) once it is due."""
        if self.delay[p] <= 0:
            raise HorovodUsageError(
                f"The gradient of {self.names[p]} was computed more than "
                f"backward_passes_per_step={self.passes} times before optimizer.step(); raise "
                "backward_passes_per_step to accumulate more backward passes locally, or call "
                "optimizer.step() (or synchronize()) in between."
            )
        self.delay[p] -= 1
        if self.delay[p] > 0:
            return
        group = self.group_of.get(p)
        if group is None:
            self.handles[p] = self._launch(p)
            return
        self.ready[group] += 1
        if self.ready[group] == len(group):
            self.handles[group] = self._launch_group(group)

    def _scales(self) -> tuple[float, float]:
        """(prescale, postscale): the predivide factor splits the averaging in two."""
        if self.op is ReduceOp.Average:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0

    def _launch(self, p: torch.Tensor) -> tuple[Operation | Handle, Any]:
        if p.grad is None:
            # No gradient here, but another process may have one (a branch this process
            # did not take): it must still take part, with zeros.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                return self._launch_sparse(p), None
            grad = grad.to_dense()
        compressed, ctx = self.compression.compress(grad)
        pre, post = self._scales()
        name = self.names[p]
        return start([compressed], self.op, pre, post, WHAT, name, self.process_set), ctx

    def _launch_sparse(self, p: torch.Tensor) -> Handle:
        return start_sparse(p.grad, self.op, WHAT, self.names[p], self.process_set)

    def _launch_group(self, group: tuple[torch.Tensor, ...]) -> tuple[Operation, Any]:
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pairs = [self.compression.compress(p.grad) for p in group]
        pre, post = self._scales()
        name = self.names[group[0]]
        compressed = [c for c, _ in pairs]
        operation = start(
            compressed, self.op, pre, post, WHAT, name, self.process_set, "grouped_allreduce"
        )
        return operation, [c for _, c in pairs]

    def synchronize(self) -> None:
        """Start the all-reduces backward did not start (parameters without a gradient
        here), wait for all of them and write the reduced gradients back."""
        launched: set[torch.Tensor] = set()
        for key in self.handles:
            launched.update(key if isinstance(key, tuple) else (key,))
        if self.reduces:
            for p in self.params:
                if p in launched:
                    continue
                group = self.group_of.get(p)
                if group is None:
                    self.handles[p] = self._launch(p)
                elif group not in self.handles:
                    self.handles[group] = self._launch_group(group)
                launched.update(group or (p,))
        for key, (handle, ctx) in self.handles.items():
            result = handle.wait()
            if isinstance(key, tuple):
                for p, reduced, c in zip(key, result, ctx, strict=True):
                    self._write(p, reduced, c)
            else:
                self._write(key, result if isinstance(handle, Handle) else result[0], ctx)
        self.reset()

    def _write(self, p: torch.Tensor, reduced: torch.Tensor, ctx: Any) -> None:
        with torch.no_grad():
            if reduced.is_sparse:
                p.grad = reduced
                return
            value = self.compression.decompress(reduced, ctx)
            if p.grad.is_sparse:  # sparse_as_dense: reduced dense, applied sparse
                p.grad = value.to_sparse()
            elif value.data_ptr() != p.grad.data_ptr():
                p.grad.copy_(value)

    def reset(self) -> None:
        """Forget the all-reduces of this step and start counting passes afresh."""
        self.handles.clear()
        for p in self.delay:
            self.delay[p] = self.passes
        for group in self.ready:
            self.ready[group] = 0

    def set_passes(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before each all-reduce."""
        self.passes = passes
        for p in self.delay:
            self.delay[p] = passes


def _forward_to(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    """The hook registered on each parameter: forward to the reducer while it lives (a
    weak reference, so a dropped optimizer does not live on through its parameters)."""

    def hook(param: torch.Tensor) -> None:
        reducer = ref()
        if reducer is not None:
            reducer.gradient_ready(param)

    return hook


def _split_evenly(params: list[torch.Tensor], count: int) -> list[tuple[torch.Tensor, ...]]:
    """`params` cut into `count` consecutive groups whose sizes differ by at most one."""
    count = max(1, min(count, len(params)))
    size, extra = divmod(len(params), count)
    groups, at = [], 0
    for i in range(count):
        n = size + (1 if i < extra else 0)
        groups.append(tuple(params[at : at + n]))
        at += n
    return [g for g in groups if g]


def _names(
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None, params: list[torch.Tensor]
) -> dict[torch.Tensor, str]:
    """Each parameter's name (its all-reduce's name): from `named_parameters`, checked,
    or generated from its index."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
        raise HorovodUsageError(
            "named_parameters must be (name, parameter) pairs; pass model.named_parameters()."
        )
    names = [n for n, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise HorovodUsageError(
            f"named_parameters repeats the name(s) {', '.join(duplicates)}; every name must "
            "be unique (model.named_parameters() gives unique names)."
        )
    by_param = {p: n for n, p in pairs}
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise HorovodUsageError(
            f"named_parameters does not name {len(missing)} of the optimizer's parameters; "
            "pass the named_parameters() of the model whose parameters the optimizer holds."
        )
    return {p: by_param[p] for p in params}


def _groups(
    groups: int | Sequence[Sequence[torch.Tensor]], params: list[torch.Tensor]
) -> list[tuple[torch.Tensor, ...]]:
    """The fusion groups: `groups` equal runs of the parameters, or the given lists plus
    one group per parameter they leave out."""
    if isinstance(groups, int):
        if groups < 1:
            raise HorovodUsageError(
                f"groups must be a positive number or a list of lists of parameters, got "
                f"{groups}; pass e.g. groups=4."
            )
        return _split_evenly(params, groups)
    seen: set[torch.Tensor] = set()
    result = []
    for group in groups:
        members = []
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise HorovodUsageError(
                    "groups must hold parameters (tensors); pass lists of the model's parameters."
                )
            if p in seen:
                raise HorovodUsageError(
                    "A parameter appears in more than one of groups; list each at most once."
                )
            seen.add(p)
            if p.requires_grad:
                members.append(p)
        if members:
            result.append(tuple(members))
    return result + [(p,) for p in params if p not in seen]
