"""Mixed precision: the compute dtype of each ``--precision``, and fp16-mixed's dynamic loss
scaling over the whole job.

fp16 keeps 10 mantissa bits, as bf16 does not, but its range ends at 65504 and small
gradients underflow to zero; so the loss is multiplied by a scale S (2**16 at first)
before backward and the gradients divided by S before the update (Micikevicius et al.,
ICLR 2018). A step whose gradients overflowed (inf or NaN) is skipped and S halved; after
2000 clean steps S doubles. torch.amp.GradScaler keeps S and applies those rules; with
several processes it is torch's ShardedGradScaler, which all-reduces the found-inf flag:
under sharded, tensor-parallel and pipelined strategies each rank sees only part of the
gradients, and a step skipped on one rank must be skipped on every one.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from dtrain.errors import ConfigError, SetupError
from dtrain.step.optimizers import needs_closure

COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
"""The dtype each mixed ``--precision`` computes in (master weights stay float32)."""

NO_CLOSURE = (
    "{name}.step re-evaluates the loss in a closure, which --precision fp16-mixed cannot "
    "scale (torch's GradScaler refuses closures); step without one, or use --precision "
    "bf16-mixed or fp32 with this optimizer."
)


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype `precision` computes in; None for fp32."""
    return COMPUTE_DTYPES.get(precision)


class LossScaling:
    """fp16-mixed's dynamic loss scale for one process of the job.

    `scale` multiplies each loss before backward, and `backward` says that a step's
    gradients carry the scale (on every rank, pipeline stages that never see the loss
    included); then the optimizer's step (wrapped by `wrap_step`, so that
    ``optimizer.step()`` in a hand-written loop does it too) divides the gradients by the
    scale unless `unscale_` already did, skips the update when any rank found an inf or
    NaN gradient, and updates the scale. A step with no scaled backward before it is the
    optimizer's own: torch.distributed.checkpoint steps with zero gradients to create
    the optimizer state it loads into.

    Args:
        device: where the losses are (the scale is kept there).
        distributed: True if several processes train the model (the flag is agreed over
            the default group, or the group `join` names once setup made it).
    """

    def __init__(self, device: torch.device, distributed: bool):
        self.scaler = (
            ShardedGradScaler(device.type, process_group=None)
            if distributed
            else torch.amp.GradScaler(device.type)
        )
        # The scale exists from the start on every rank: pipeline stages before the last
        # never scale a loss themselves, yet unscale their gradients.
        self.scaler.scale(torch.ones((), device=device))
        self.skipped = 0
        """Optimizer steps skipped because a gradient overflowed."""
        self._pending = False
        """A backward of scaled losses ran since the last step."""
        self._unscaled = False
        self._in_scaler = False
        self._updated = False

    def join(self, group: dist.ProcessGroup | None) -> None:
        """Agree the found-inf flags over `group`, the processes that step together, read
        once the strategy's setup made it (a parameter server's workers exist only after
        its handshake); None: the default group."""
        if isinstance(self.scaler, ShardedGradScaler):
            self.scaler.process_group = group

    @property
    def scale_value(self) -> float:
        """The current loss scale (read back from the device)."""
        return self.scaler.get_scale()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale, to back-propagate."""
        return self.scaler.scale(loss)

    def backward(self) -> None:
        """A backward of scaled losses is running: the next step unscales and may skip."""
        self._pending = True

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the gradients `optimizer` steps by the scale and agree over the job
        whether any overflowed; once per step (later calls before the step do nothing, as
        do calls when no scaled backward ran)."""
        if self._unscaled or not self._pending:
            return
        with warnings.catch_warnings():
            # The scaler's 1-element inverse scale meets DTensor gradients (tensor
            # parallel, FSDP2): DTensor notes that it treats it as replicated, as it is.
            warnings.filterwarnings("ignore", "Found a non-scalar tensor", UserWarning)
            self.scaler.unscale_(optimizer)
        self._unscaled = True

    def wrap_step(self, optimizer: Optimizer, skipped: Callable[[bool], None]) -> None:
        """Make ``optimizer.step()`` the scaler's step: unscale, step unless a gradient
        overflowed on any rank, update the scale. `skipped` is called after each skipped
        step, told whether the optimizer's step (and its hooks) ran: GradScaler calls a
        fused optimizer's step, whose kernel skips the update itself."""
        name = type(optimizer).__name__
        if needs_closure(optimizer):
            raise ConfigError(NO_CLOSURE.format(name=name))
        original = optimizer.step

        # wraps: a learning-rate scheduler built before engine.setup marked the step it
        # wrapped; the mark stays, so the scheduler does not warn that the step changed.
        @functools.wraps(original)
        def step(_: Optimizer, *args: Any, **kwargs: Any) -> Any:
            if self._in_scaler or not self._pending:
                # GradScaler.step calling the optimizer (the update itself), or a step of
                # gradients that carry no scale.
                self._updated = True
                return original(*args, **kwargs)
            if args or kwargs.pop("closure", None) is not None:  # GradScaler refuses it
                raise SetupError(NO_CLOSURE.format(name=name))
            self.unscale_(optimizer)
            before = self.scaler.get_scale()
            self._in_scaler, self._updated = True, False
            try:
                result = self.scaler.step(optimizer, *args, **kwargs)
            finally:
                self._in_scaler = False
            self.scaler.update()
            self._unscaled = self._pending = False
            if self.scaler.get_scale() < before:  # halved: a gradient overflowed
                self.skipped += 1
                skipped(self._updated)
            return result

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def state_dict(self) -> dict[str, Any]:
        """The scale and its growth tracker, for checkpoints."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's scale and growth tracker."""
        self.scaler.load_state_dict(state)
