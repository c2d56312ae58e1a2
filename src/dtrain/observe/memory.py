"""Model-state memory per rank: bytes of parameters, gradients and optimizer state.

Parameters are counted twice: between steps, and from forward to backward (when FSDP2
holds gathered parameters: all of them under zero2, the blocks in flight under zero3).

Counts what this rank holds: the local shard of a sharded (DTensor) tensor, the local
partition of a ZeroRedundancyOptimizer. Compare with the ZeRO paper's per-device model
states (fp32 Adam, psi parameters, N ranks): DDP 16 psi; stage 1 8 psi + 8 psi/N;
stage 2 4 psi + 12 psi/N; stage 3 16 psi/N. Not counted: activations, DDP's gradient
buckets, communication buffers and the gathered parameters of blocks in flight.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from dtrain.observe.events import End, Observer, Run
from dtrain.observe.metrics import format_memory
from dtrain.process.collectives import gather_objects


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by this rank for `tensors` (the local shard of DTensors)."""
    # A DTensor exists only once torch.distributed.tensor was imported; not importing it
    # here keeps the launcher, which sizes checkpoints through this function, light.
    dtensor = sys.modules.get("torch.distributed.tensor")
    total = 0
    for t in tensors:
        local = t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t
        total += local.numel() * local.element_size()
    return total


class InStep:
    """The most parameter bytes `model` held inside one training step: read when its
    forward ends (FSDP2 under zero2 keeps every gathered parameter from then until
    backward, and has resharded them once backward is over) and after each
    forward + backward (`read`; a pipeline's stages never call the model's own forward)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peak = 0

    def read(self) -> None:
        """Count what the model holds now."""
        self.peak = max(self.peak, parameter_bytes(self.model))

    @contextmanager
    def watching(self) -> Iterator[InStep]:
        """While open, also read whenever the model's forward ends."""
        handle = self.model.register_forward_hook(lambda *_: self.read())
        try:
            yield self
        finally:
            handle.remove()


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients this rank holds now."""
    return local_bytes(p.grad for p in model.parameters() if p.grad is not None)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards under FSDP)."""
    return local_bytes(model.parameters())


def optimizer_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state on this rank (its partition under ZeRO stage 1)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local part
    return local_bytes(
        v for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )


class MemoryReport(Observer):
    """``memory_report=True``: this rank's model-state bytes, measured over its first
    `train_step`, and every rank's, gathered when asked and printed at the end of the run.

    Args:
        enabled: measure (``memory_report``); otherwise only `report` works (with no bytes).
        rank: this process's global rank, for the report's rows.
        is_main: True on the rank that prints the table.
    """

    def __init__(self, enabled: bool, rank: int, is_main: bool) -> None:
        self.enabled = enabled
        self.rank = rank
        self.is_main = is_main
        self.memory: dict[str, int] | None = None
        """Model-state bytes of this rank after its first step."""
        self._report: list[dict[str, int]] | None = None
        self._run: Run | None = None
        self._held: InStep | None = None
        """The step being measured (only the first)."""
        self._gradients = 0
        self._watching = ExitStack()

    def listens_to(self, event: str) -> bool:
        return self.enabled or event in ("on_setup", "on_close")  # `report` needs the run

    def on_setup(self, run: Run) -> None:
        self._run = run

    def on_step_start(self, step: int) -> None:
        if self.enabled and self.memory is None and self._run is not None:
            self._held = InStep(self._run.module)
            self._watching.enter_context(self._held.watching())

    def on_micro_end(self) -> None:
        if self._held is not None:
            self._held.read()

    def on_gradients(self, step: int, loss: torch.Tensor) -> None:
        if self._held is not None and self._run is not None:
            self._gradients = gradient_bytes(self._run.module)

    def on_step_end(self, step: int, loss: torch.Tensor | None) -> None:
        held, self._held = self._held, None
        if held is None:
            return  # measured already, or not at all
        self._watching.close()
        run = self._run
        if loss is None or run is None or run.optimizer is None:
            return  # not measuring, or the step failed: the next one measures
        self.memory = {
            "parameters": parameter_bytes(run.module),
            "parameters_in_step": held.peak,
            "gradients": self._gradients,
            "optimizer": optimizer_bytes(run.optimizer),
        }

    def report(self) -> list[dict[str, int]]:
        """Every rank's `memory` with its rank (collective over the training processes the
        first time after the first step; then kept, as the figures do not change)."""
        if self._report is None or self.memory is None:
            mine = dict(self.memory or {}, rank=self.rank)
            self._report = gather_objects(mine, self._run.group if self._run else None)
        return self._report

    def on_close(self, end: End) -> None:
        if not (self.enabled and end.together):
            return
        end.results["memory"] = self.report()
        if self.is_main:
            table = format_memory(end.results["memory"])
            print(f"dtrain: model state per rank\n{table}", flush=True)
