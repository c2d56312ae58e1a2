"""`hvd.DistributedOptimizer`: the user's optimizer, with every gradient all-reduced as
backward produces it.

Each parameter gets a post-accumulate-grad hook; once a parameter's gradient has been
accumulated `backward_passes_per_step` times, the hook starts an asynchronous all-reduce
of it (in place, or of its compressed copy), so communication overlaps the rest of
backward. `step()` (or `synchronize()`) waits for them and writes the averaged gradients
back before the wrapped optimizer updates the parameters.

The returned object is an instance of a subclass of the optimizer's own class that shares
the original's parameter groups, state and defaults, so it is a `torch.optim.Optimizer`
to the rest of the script: `param_groups`, `state_dict`, `zero_grad` and learning-rate
schedulers (built before or after wrapping) work as before.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allgather import start as start_allgather
from dtrain.horovod.allreduce import start, start_grouped
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.handles import Handle
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, resolve

Key = torch.Tensor | tuple[torch.Tensor, ...]


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


def _fire(ref: weakref.ref, param: torch.Tensor) -> None:
    """The post-accumulate-grad hook: forward to the optimizer while it lives."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._hvd_gradient_ready(param)


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods a DistributedOptimizer adds to (or wraps around) the user's class; the
    class built by `DistributedOptimizer` puts this first in its bases."""

    def _hvd_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: int | Sequence[Sequence[torch.Tensor]] | None,
        sparse_as_dense: bool,
        original: torch.optim.Optimizer,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self._hvd_names = _names(named_parameters, params)
        self._hvd_compression = compression
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_original = weakref.ref(original)
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_params: list[torch.Tensor] = []
        self._hvd_delay: dict[torch.Tensor, int] = {}
        self._hvd_handles: dict[Key, tuple[Handle, Any]] = {}
        self._hvd_group_of: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}
        self._hvd_ready: dict[tuple[torch.Tensor, ...], int] = {}
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_hooks: list[Any] = []
        # As in Horovod, one process needs no hooks: there is nothing to reduce.
        self._hvd_reduces = basics.size() > 1
        self._hvd_track(params)
        if groups is not None:
            for group in _groups(groups, self._hvd_params):
                self._hvd_ready[group] = 0
                for p in group:
                    self._hvd_group_of[p] = group

    def _hvd_track(self, params: list[torch.Tensor]) -> None:
        """Reduce the gradients of `params` (those that require one) from now on."""
        ref = weakref.ref(self)
        for p in params:
            if not p.requires_grad or p in self._hvd_delay:
                continue
            self._hvd_names.setdefault(p, f"allreduce.noname.{len(self._hvd_names)}")
            self._hvd_params.append(p)
            self._hvd_delay[p] = self.backward_passes_per_step
            if self._hvd_reduces:
                hook = p.register_post_accumulate_grad_hook(lambda t, r=ref: _fire(r, t))
                self._hvd_hooks.append(hook)

    # --- gradients as backward produces them ------------------------------------------

    def _hvd_gradient_ready(self, p: torch.Tensor) -> None:
        if self._hvd_delay[p] <= 0:
            raise HorovodUsageError(
                f"The gradient of {self._hvd_names[p]} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "optimizer.step(); raise backward_passes_per_step to accumulate more backward "
                "passes locally, or call optimizer.step() (or synchronize()) in between."
            )
        self._hvd_delay[p] -= 1
        if self._hvd_delay[p] > 0:
            return
        group = self._hvd_group_of.get(p)
        if group is None:
            self._hvd_handles[p] = self._hvd_launch(p)
            return
        self._hvd_ready[group] += 1
        if self._hvd_ready[group] == len(group):
            self._hvd_handles[group] = self._hvd_launch_group(group)

    def _hvd_scales(self) -> tuple[float, float]:
        """(prescale, postscale): the predivide factor splits the averaging in two."""
        if self._hvd_op is ReduceOp.Average:
            return 1.0 / self._hvd_predivide, self._hvd_predivide
        return 1.0, 1.0

    def _hvd_launch(self, p: torch.Tensor) -> tuple[Handle, Any]:
        if p.grad is None:
            # No gradient here, but another process may have one (a branch this process
            # did not take): it must still take part, with zeros.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        name = self._hvd_names[p]
        if grad.is_sparse:
            if not self._hvd_sparse_as_dense:
                return self._hvd_launch_sparse(p, name), None
            grad = grad.to_dense()
        compressed, ctx = self._hvd_compression.compress(grad)
        pre, post = self._hvd_scales()
        return start(compressed, self._hvd_op, pre, post, "DistributedOptimizer", name), ctx

    def _hvd_launch_sparse(self, p: torch.Tensor, name: str) -> Handle:
        grad = p.grad.coalesce()
        indices = grad.indices().t().contiguous()
        handle, _ = start_allgather([indices, grad.values()], "DistributedOptimizer", name)
        size = basics.size()

        def finish() -> torch.Tensor:
            all_indices, values = handle.wait()
            if self._hvd_op is ReduceOp.Average:
                values = values / size
            return torch.sparse_coo_tensor(all_indices.t(), values, grad.shape).coalesce()

        return Handle([handle], finish, "DistributedOptimizer", name)

    def _hvd_launch_group(self, group: tuple[torch.Tensor, ...]) -> tuple[Handle, Any]:
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pairs = [self._hvd_compression.compress(p.grad) for p in group]
        pre, post = self._hvd_scales()
        name = self._hvd_names[group[0]]
        handle = start_grouped(
            [c for c, _ in pairs], self._hvd_op, pre, post, "DistributedOptimizer", name
        )
        return handle, [c for _, c in pairs]

    # --- the optimizer's public surface -----------------------------------------------

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce (starting those backward did not start,
        in parameter order) and write the reduced gradients back."""
        launched: set[torch.Tensor] = set()
        for key in self._hvd_handles:
            launched.update(key if isinstance(key, tuple) else (key,))
        if self._hvd_reduces:
            for p in self._hvd_params:
                if p in launched:
                    continue
                group = self._hvd_group_of.get(p)
                if group is None:
                    self._hvd_handles[p] = self._hvd_launch(p)
                elif group not in self._hvd_handles:
                    self._hvd_handles[group] = self._hvd_launch_group(group)
                launched.update(group or (p,))
        for key, (handle, ctx) in self._hvd_handles.items():
            result = handle.wait()
            if isinstance(key, tuple):
                for p, reduced, c in zip(key, result, ctx, strict=True):
                    self._hvd_write(p, reduced, c)
            else:
                self._hvd_write(key, result, ctx)
        self._hvd_reset()
        self._hvd_synchronized = True

    def _hvd_write(self, p: torch.Tensor, reduced: torch.Tensor, ctx: Any) -> None:
        with torch.no_grad():
            if reduced.is_sparse:
                p.grad = reduced
                return
            value = self._hvd_compression.decompress(reduced, ctx)
            if p.grad.is_sparse:  # sparse_as_dense: reduced dense, applied sparse
                p.grad = value.to_sparse()
            elif value.data_ptr() != p.grad.data_ptr():
                p.grad.copy_(value)

    def _hvd_reset(self) -> None:
        self._hvd_handles.clear()
        for p in self._hvd_delay:
            self._hvd_delay[p] = self.backward_passes_per_step
        for group in self._hvd_ready:
            self._hvd_ready[group] = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block, `step()` does not synchronize: call `synchronize()` yourself
        first (to clip the reduced gradients, for example)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before each all-reduce."""
        if passes < 1:
            raise HorovodUsageError(
                f"backward_passes_per_step must be at least 1, got {passes}; pass 1 to "
                "reduce after every backward pass."
            )
        self.backward_passes_per_step = passes
        for p in self._hvd_delay:
            self._hvd_delay[p] = passes

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Synchronize the gradients (unless inside `skip_synchronize()`), then update."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() was called after optimizer.synchronize() outside "
                    "`with optimizer.skip_synchronize():`, so the gradients are reduced a "
                    "second time; wrap the step in that block.",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        original = self._hvd_original()
        if original is not None and hasattr(original.__dict__.get("step"), "_wrapped_by_lr_sched"):
            # A scheduler built on the original optimizer watches its step for this flag.
            original._opt_called = True  # type: ignore[attr-defined]
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused while all-reduces are under way."""
        if self._hvd_handles:
            raise HorovodUsageError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(), while gradients are being "
                "all-reduced; call optimizer.step() (or synchronize()) first."
            )
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the wrapped optimizer does, dropping any all-reduce under way."""
        self._hvd_reset()
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        groups, state = self.param_groups, self.state
        super().load_state_dict(state_dict)
        # torch builds new group dicts and a new state; fill the old objects instead, which
        # the original optimizer (and a scheduler built on it) still hold.
        for old, new in zip(groups, self.param_groups, strict=True):
            old.clear()
            old.update(new)
        state.clear()
        state.update(self.state)
        self.param_groups, self.state = groups, state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as the wrapped optimizer does; its gradients are reduced too."""
        super().add_param_group(param_group)
        if hasattr(self, "_hvd_delay"):
            self._hvd_track(list(self.param_groups[-1]["params"]))


def _names(
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None, params: list[torch.Tensor]
) -> dict[torch.Tensor, str]:
    """Each parameter's name (for messages): from `named_parameters`, checked, or generated."""
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


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """`optimizer`, with each gradient all-reduced (`op`: Average or Sum) over every
    process as backward produces it; `step()` waits for them before updating.

    Args:
        optimizer: the torch optimizer to wrap (its class, groups and state are kept).
        named_parameters: ``model.named_parameters()``, for messages naming parameters.
        compression: ``hvd.Compression.fp16`` sends gradients as float16.
        backward_passes_per_step: backward passes accumulated locally before each
            all-reduce (scale the loss by its inverse to average over them).
        op: hvd.Average (default) or hvd.Sum.
        gradient_predivide_factor: Average only: divide by this before the sum and by
            size/factor after it (the same average, reached in two steps).
        num_groups: deprecated form of an integer `groups`.
        groups: fuse gradients into this many all-reduces, or into the given lists of
            parameters (one fused all-reduce per list once all its gradients are ready).
        sparse_as_dense: all-reduce sparse gradients as dense tensors instead of
            all-gathering their indices and values.
        process_set: only the global process set in this version.
    """
    basics.context("DistributedOptimizer")
    process_sets.check(process_set)
    chosen = resolve(op)
    if chosen not in (ReduceOp.Average, ReduceOp.Sum):
        raise HorovodUsageError(
            f"DistributedOptimizer reduces gradients with hvd.Average or hvd.Sum, got "
            f"hvd.{chosen.name}; pass one of those."
        )
    if gradient_predivide_factor != 1.0 and chosen is not ReduceOp.Average:
        raise HorovodUsageError(
            "gradient_predivide_factor splits an average in two, so it needs op=hvd.Average; "
            "drop gradient_predivide_factor or use op=hvd.Average."
        )
    if backward_passes_per_step < 1:
        raise HorovodUsageError(
            f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}; "
            "pass 1 to reduce after every backward pass."
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise HorovodUsageError(
            "This optimizer is already a DistributedOptimizer; wrap the plain optimizer once."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise HorovodUsageError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass the optimizer you built on the model."
        )
    if num_groups:
        warnings.warn(
            "num_groups is deprecated in Horovod; pass groups=N instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        groups = num_groups if groups is None else groups
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__qualname__": base.__qualname__})
    wrapped = cls.__new__(cls)
    # Share (not copy) the groups, state and defaults; a scheduler's wrapper of the
    # original's step stays behind, so this object's own step runs.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._hvd_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        chosen,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        optimizer,
    )
    return wrapped
