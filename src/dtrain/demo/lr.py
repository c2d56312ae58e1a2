"""Learning-rate rules for data parallelism.

Growing the global batch calls for a larger learning rate. Relative to a reference batch
b0 at learning rate lr0, a global batch B gets:

* ``linear``: lr0 * B / b0 (Goyal et al. 2017), with a gradual warmup from lr0;
* ``sqrt``:   lr0 * sqrt(B / b0) (Krizhevsky 2014; batch 100 at lr 0.001 on one GPU
  becomes batch 400 at lr 0.002 on four);
* ``none``:   lr0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtrain.command_names import LR_RULES
from dtrain.errors import ConfigError


def scale_lr(lr: float, global_batch: int, reference_batch: int, rule: str) -> float:
    """The learning rate for `global_batch` under `rule`, from `lr` at `reference_batch`."""
    if rule not in LR_RULES:
        raise ConfigError(f"Unknown --lr-scaling '{rule}'; choose one of {', '.join(LR_RULES)}.")
    if reference_batch < 1:
        raise ConfigError(f"The reference batch must be at least 1, got {reference_batch}.")
    ratio = global_batch / reference_batch
    return {"none": lr, "linear": lr * ratio, "sqrt": lr * math.sqrt(ratio)}[rule]


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup from `start` to `peak`, then cosine decay to zero at `total_steps`.

    ``schedule(step)`` is the learning rate of the update that takes the step count from
    `step` to `step + 1`; it depends on the step alone, so a resumed run continues the
    same curve.
    """

    peak: float
    start: float
    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start + (self.peak - self.start) * step / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.peak * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every parameter group's learning rate for `step`; return it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
