"""`hvd.DistributedOptimizer`: the user's optimizer, with every gradient all-reduced as
backward produces it.

The hooks and all-reduces live in `gradient_hooks.GradientReducer`; `step()` (or
`synchronize()`) waits for them and writes the averaged gradients back before the wrapped
optimizer updates the parameters.

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
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.errors import HorovodUsageError
from dtrain.horovod.gradient_hooks import GradientReducer
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp, resolve


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods a DistributedOptimizer adds to (or wraps around) the user's class; the
    class built by `DistributedOptimizer` puts this first in its bases."""

    def _hvd_setup(self, reducer: GradientReducer, original: torch.optim.Optimizer) -> None:
        self._hvd = reducer
        self._hvd_original = weakref.ref(original)
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each parameter's name, by parameter: the attribute Horovod's optimizer keeps
        (scripts read it to match parameters across processes)."""
        return self._hvd.names

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before each all-reduce."""
        return self._hvd.passes

    # --- the optimizer's public surface -----------------------------------------------

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce (starting those backward did not start)
        and write the reduced gradients back."""
        self._hvd.synchronize()
        self._hvd_synchronized = True

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
        self._hvd.set_passes(passes)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Synchronize the gradients (unless inside `skip_synchronize()`), then update."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                # Horovod's words (scripts and tests match them), then what to do.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(), so the gradients are reduced a second "
                    "time; wrap the step in `with optimizer.skip_synchronize():`.",
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
        if self._hvd.handles:
            raise HorovodUsageError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(), while gradients are being "
                "all-reduced; call optimizer.step() (or synchronize()) first."
            )
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the wrapped optimizer does, dropping any all-reduce under way."""
        self._hvd.reset()
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
        if hasattr(self, "_hvd"):
            self._hvd.track(list(self.param_groups[-1]["params"]))


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
        process_set: the processes whose gradients are averaged (default: all); on a
            process outside it, as in Horovod, the optimizer steps on local gradients.
    """
    basics.context("DistributedOptimizer")
    ranks = process_sets.registered(process_set, "DistributedOptimizer")
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
    params = [p for group in wrapped.param_groups for p in group["params"]]
    reducer = GradientReducer(
        params,
        named_parameters,
        compression,
        chosen,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
        backward_passes_per_step,
        groups,
        included=basics.rank() in ranks,
    )
    wrapped._hvd_setup(reducer, optimizer)
    return wrapped
