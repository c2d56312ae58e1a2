"""Batch normalization over the global batch, on CPU and GPU alike.

With data parallelism each worker's BatchNorm normalises its own share of the batch: the
mean and variance it subtracts and divides by, and so the gradients of every layer before
it, differ from those of one process on the whole batch (the parameters train differently,
not only the running statistics). Synchronised batch normalization (Ioffe and Szegedy
2015; torch.nn.SyncBatchNorm, Horovod's hvd.SyncBatchNorm) takes the statistics over every
worker's share, which is exactly what one process computes on the global batch.

torch.nn.SyncBatchNorm runs only on GPUs (its kernels, torch.batch_norm_stats and friends,
have no CPU form), so the statistics are combined here with plain tensor ops and two
collectives, given by an :class:`Exchange`. Forward all-gathers each worker's (count, mean,
sum of squared deviations) per channel and merges them (Chan et al.'s parallel variance),
so workers may hold batches of different sizes. Backward all-reduces the two per-channel
sums the input gradient needs. The gradients of weight and bias stay local: the strategy
averages them like any other.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's usual alias
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dtrain.process.logs import LOGGER


class Exchange(Protocol):
    """The two collectives synchronised batch normalization needs."""

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every worker's `row` (1, K), stacked in rank order: (workers, K)."""
        ...

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the workers."""
        ...


class GroupExchange:
    """The collectives over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        table = row.new_empty((dist.get_world_size(self.group), row.shape[1]))
        dist.all_gather_single(table, row.contiguous(), group=self.group)
        return table

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values, group=self.group)
        return values


def _per_channel(x: torch.Tensor) -> list[int]:
    """The dimensions to reduce over: all but the channel dimension (1)."""
    return [d for d in range(x.dim()) if d != 1]


def _shape(x: torch.Tensor) -> list[int]:
    """Broadcast shape of a per-channel vector against `x`: (1, C, 1, ...)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with the statistics of every worker's batch; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, running_mean, running_var, eps, momentum, exchange):  # type: ignore[override]
        dims, channels = _per_channel(x), x.shape[1]
        count = x.numel() // channels
        mean = x.mean(dims)
        m2 = ((x - mean.view(_shape(x))) ** 2).sum(dims)
        row = torch.cat([x.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
        table = exchange.gather_rows(row.detach())
        counts, means, m2s = table[:, :1], table[:, 1 : 1 + channels], table[:, 1 + channels :]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        var = global_m2 / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(global_mean, alpha=momentum)
                unbiased = global_m2 / (total - 1).clamp(min=1)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - global_mean.view(_shape(x))) * invstd.view(_shape(x))
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.exchange = total, exchange
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
            # Every worker's loss reaches this worker's input through the shared
            # statistics: the two sums are taken over the whole batch.
            both = ctx.exchange.sum(torch.cat([sum_dy, sum_dy_xhat]))
            channels = sum_dy.numel()
            mean_dy = (both[:channels] / ctx.total).view(_shape(grad))
            mean_dy_xhat = (both[channels:] / ctx.total).view(_shape(grad))
            scale = invstd if weight is None else invstd * weight
            grad_input = scale.view(_shape(grad)) * (grad - mean_dy - xhat * mean_dy_xhat)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncNorm(_BatchNorm):
    """Batch normalization of inputs (N, C, ...) over every worker's batch. In training (or
    without running statistics) the mean and variance cover the global batch and the
    running statistics are updated from them; in evaluation the running statistics are
    used, as in `torch.nn.BatchNorm*d`. Subclasses say who the workers are."""

    def exchange(self) -> Exchange | None:
        """The collectives over the workers, or None when this worker is alone."""
        raise NotImplementedError

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(
                f"{type(self).__name__} expects an input of shape (N, C, ...), got "
                f"{input.dim()} dimension(s); add a batch dimension."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        """Normalize `input` (N, C, ...) over the global batch (training) or with the
        running statistics (evaluation)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or not self.track_running_stats
        exchange = self.exchange() if use_batch else None
        if exchange is None:
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
            exchange,
        )


class GroupSyncBatchNorm(SyncNorm):
    """Synchronised batch normalization over a torch.distributed process group (the
    data-parallel workers), on CPU (gloo) and GPU."""

    def __init__(self, source: _BatchNorm, group: dist.ProcessGroup | None) -> None:
        super().__init__(
            source.num_features,
            source.eps,
            source.momentum,
            source.affine,
            source.track_running_stats,
        )
        self._group = GroupExchange(group)
        with torch.no_grad():
            if source.affine:
                self.weight = source.weight
                self.bias = source.bias
            if source.track_running_stats:
                self.running_mean = source.running_mean
                self.running_var = source.running_var
                self.num_batches_tracked = source.num_batches_tracked
        self.training = source.training

    def exchange(self) -> Exchange | None:
        return self._group if dist.get_world_size(self._group.group) > 1 else None


def convert_sync_batchnorm(
    model: nn.Module, group: dist.ProcessGroup | None, device: torch.device
) -> nn.Module:
    """`model` with every BatchNorm layer synchronised over `group`: torch's SyncBatchNorm
    when training on GPUs (`device`; its fused kernels), :class:`GroupSyncBatchNorm`
    elsewhere. The layers keep their parameters, buffers and names."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    if isinstance(model, _BatchNorm) and not isinstance(model, SyncNorm):
        return GroupSyncBatchNorm(model, group)
    for name, child in model.named_children():
        converted = convert_sync_batchnorm(child, group, device)
        if converted is not child:
            setattr(model, name, converted)
    return model


def warn_unsynced_batchnorm(model: nn.Module, shares: int, share: str, fix: str) -> None:
    """Say once, naming the layers, that `model`'s BatchNorm layers will normalise each of
    `shares` parts of the batch by itself (a `share` such as "process's" or "tower's"), so
    the parameters train differently from one device on the whole batch; `fix` says what
    to do instead. Nothing to say with one share or no BatchNorm."""
    norms = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if not norms or shares == 1:
        return
    message = (
        f"dtrain: {', '.join(norms[:3])}{' ...' if len(norms) > 3 else ''} normalise each "
        f"{share} share of the batch (1/{shares} of it), so the model trains differently "
        "from one device on the whole batch (the parameters, not only the running "
        f"statistics). {fix}"
    )
    LOGGER.warning(message)
    warnings.warn(message, stacklevel=5)
