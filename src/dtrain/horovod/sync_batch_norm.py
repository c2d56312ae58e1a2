"""`hvd.SyncBatchNorm`: batch normalization whose statistics cover the batch of every
process of a process set, not just this process's share (Ioffe and Szegedy 2015; the
synchronised form as in Horovod and torch.nn.SyncBatchNorm).

torch.nn.SyncBatchNorm runs only on GPUs (its kernels, torch.batch_norm_stats and
friends, have no CPU form), so the statistics are combined here with plain tensor ops and
Horovod's own collectives, on CPU and GPU alike. Forward all-gathers each process's
(count, mean, sum of squared deviations) per channel and merges them (Chan et al.'s
parallel variance), so processes may hold batches of different sizes. Backward all-reduces
the two per-channel sums the input gradient needs. The gradients of weight and bias stay
local: DistributedOptimizer averages them like any other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's usual alias
from torch.nn.modules.batchnorm import _BatchNorm

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allgather import start as start_allgather
from dtrain.horovod.allreduce import start as start_allreduce
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp


def _per_channel(x: torch.Tensor) -> list[int]:
    """The dimensions to reduce over: all but the channel dimension (1)."""
    return [d for d in range(x.dim()) if d != 1]


def _shape(x: torch.Tensor) -> list[int]:
    """Broadcast shape of a per-channel vector against `x`: (1, C, 1, ...)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with the statistics of the whole set's batch; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, running_mean, running_var, eps, momentum, ps):  # type: ignore[override]
        dims, channels = _per_channel(x), x.shape[1]
        count = x.numel() // channels
        mean = x.mean(dims)
        m2 = ((x - mean.view(_shape(x))) ** 2).sum(dims)
        row = torch.cat([x.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
        (table,), _ = start_allgather([row.detach()], "SyncBatchNorm", "sync_batch_norm", ps).wait()
        counts, means, m2s = table[:, :1], table[:, 1 : 1 + channels], table[:, 1 + channels :]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        var = global_m2 / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(global_mean, alpha=momentum)
                unbiased = global_m2 / max(total.item() - 1, 1)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - global_mean.view(_shape(x))) * invstd.view(_shape(x))
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.ps = total, ps
        out = xhat
        if weight is not None:
            out = out * weight.view(_shape(x)) + bias.view(_shape(x))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        xhat, weight, invstd = ctx.saved_tensors
        dims = _per_channel(grad)
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * xhat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if weight is not None else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # Every process's loss reaches this process's input through the shared
            # statistics: the two sums are taken over the whole set's batch.
            both = start_allreduce(
                [torch.cat([sum_dy, sum_dy_xhat])], ReduceOp.Sum, 1.0, 1.0, "SyncBatchNorm",
                "sync_batch_norm.grad", ctx.ps,
            ).wait()[0]  # fmt: skip
            channels = sum_dy.numel()
            mean_dy = (both[:channels] / ctx.total).view(_shape(grad))
            mean_dy_xhat = (both[channels:] / ctx.total).view(_shape(grad))
            scale = invstd if weight is None else invstd * weight
            grad_input = scale.view(_shape(grad)) * (grad - mean_dy - xhat * mean_dy_xhat)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batches of every process of `process_set`, for
    inputs of shape (N, C, ...). In training (or without running statistics) the mean and
    variance cover the whole set's batch and the running statistics are updated from them;
    in evaluation the running statistics are used, as in `torch.nn.BatchNorm*d`. One
    process alone behaves as a plain BatchNorm.

    Args:
        num_features: C, the number of channels.
        eps, momentum, affine, track_running_stats: as in torch.nn.BatchNorm1d.
        process_set: the processes whose batches are normalized together (default: all).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(
                f"hvd.SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()} "
                "dimension(s); add a batch dimension."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        """Normalize `input` (N, C, ...) over the set's batch (training) or with the running
        statistics (evaluation)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or not self.track_running_stats
        single = (
            basics.size() == 1 or len(process_sets.members(self.process_set, "SyncBatchNorm")) == 1
        )
        if not use_batch or single:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch,
                factor,
                self.eps,
            )
        tracking = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if tracking else None,
            self.running_var if tracking else None,
            self.eps,
            factor,
            self.process_set,
        )
