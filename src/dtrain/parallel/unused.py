"""Parameters a step left without a gradient, caught before DDP averages a wrong step.

DDP (Li et al., VLDB 2020) reduces a bucket once every parameter in it has its gradient.
Without ``find_unused_parameters`` it waits for all of them: one that took no part in the
loss (a branch skipped always or on some steps) leaves its bucket unreduced, so that
step's update is silently wrong, and DDP only complains at the next forward. After each
synchronising backward the watch asks DDP's reducer whether it finalised the backward (one
call into C++, no communication); only when it did not are the parameters named (by the
indices the reducer lists, else by looking for the ones without a gradient), and the step
is refused before the optimizer applies it.
"""

from __future__ import annotations

import re

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.errors import SetupError


class UnusedWatch:
    """The trainable parameters of a model replicated by DDP without
    ``find_unused_parameters``, checked after each synchronising backward."""

    def __init__(self, model: nn.Module, ddp: DistributedDataParallel, strategy: str) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.ddp = ddp
        self.strategy = strategy

    def check(self) -> None:
        """Raise a SetupError naming the parameters that got no gradient, if DDP's reducer
        did not finalise the backward."""
        try:
            self.ddp.reducer._check_reducer_finalized()
            return
        except RuntimeError as error:
            unused = self._named(str(error))
        names = f"Parameter(s) {', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}"
        raise SetupError(
            f"{names if unused else 'Some parameter(s)'} got no gradient from this "
            f"backward (they took no part in the loss), which strategy {self.strategy} "
            "cannot average without being told. Pass --find-unused-parameters "
            "(dtrain.init(find_unused_parameters=True)) when some parameters are skipped "
            "always or sometimes, or freeze the ones never used (p.requires_grad_(False)) "
            "before engine.setup."
        )

    def _named(self, error: str) -> list[str]:
        """The parameters the reducer's `error` lists by index (among those it reduces,
        in its order), else the ones without a gradient (a parameter left out of the last
        micro-batch only keeps the one an earlier micro-batch accumulated)."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", error)
        reduced = [
            n
            for n, p in self.ddp.module.named_parameters()
            if p.requires_grad and n not in self.ddp.parameters_to_ignore
        ]
        if found is not None:
            indices = [int(i) for i in found.group(1).split()]
            if all(i < len(reduced) for i in indices):
                return [reduced[i] for i in indices]
        return [n for n, p in self.params if p.grad is None]
