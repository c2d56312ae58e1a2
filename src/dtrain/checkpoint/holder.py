"""What the checkpoint formats ask of whoever holds the training state.

A runtime strategy fulfils :class:`StateHolder` (its checkpoint state,
`dtrain.strategies.checkpoint_state.CheckpointState`, supplies the defaults); the formats
type against this protocol so that they know no strategy, only what a save or a load
reads of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.optim import Optimizer

    from dtrain.config import Config
    from dtrain.process.topology import Topology


class StateHolder(Protocol):
    """The model and optimizer state of one rank, and the ranks that write it together."""

    topology: Topology
    config: Config

    @property
    def state_by_module(self) -> bool:
        """True if `unwrap()`'s parameters (and a torch optimizer over them) hold this
        rank's part of the state, so DCP reads and writes it directly; False sends the
        state through `full_state` / `load_full_state`."""
        ...

    @property
    def model_class(self) -> str:
        """The class name of the model given to setup."""
        ...

    @property
    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The process group whose ranks save and load a checkpoint together (None: the
        default group)."""
        ...

    def unwrap(self) -> nn.Module:
        """This rank's part of the user's model, under canonical names."""
        ...

    def refresh(self) -> None:
        """Bring this rank's parameters up to date before they are read (collective where
        needed)."""
        ...

    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """The whole model and name-keyed optimizer state on the main rank; (None, None)
        elsewhere (collective)."""
        ...

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        """Load whole tensors and name-keyed optimizer state; the names skipped with
        strict=False."""
        ...
