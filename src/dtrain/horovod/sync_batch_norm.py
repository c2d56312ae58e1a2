"""`hvd.SyncBatchNorm`: batch normalization whose statistics cover the batch of every
process of a process set, not just this process's share, on CPU and GPU alike.

The statistics are merged by `dtrain.parallel.sync_batchnorm` (the same code the
strategies' ``--sync-batchnorm`` runs); here its two collectives are Horovod's own, over
the process set, so they take part in Horovod's negotiation like any named operation.
"""

from __future__ import annotations

import torch

from dtrain.horovod import basics, process_sets
from dtrain.horovod.allgather import start as start_allgather
from dtrain.horovod.allreduce import start as start_allreduce
from dtrain.horovod.process_sets import ProcessSet, global_process_set
from dtrain.horovod.reduction import ReduceOp
from dtrain.parallel.sync_batchnorm import Exchange, SyncNorm


class _ProcessSetExchange:
    """The collectives of synchronised batch normalization over a Horovod process set."""

    def __init__(self, process_set: ProcessSet) -> None:
        self.process_set = process_set

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        (table,), _ = start_allgather(
            [row], "SyncBatchNorm", "sync_batch_norm", self.process_set
        ).wait()
        return table

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return start_allreduce(
            [values], ReduceOp.Sum, 1.0, 1.0, "SyncBatchNorm", "sync_batch_norm.grad",
            self.process_set,
        ).wait()[0]  # fmt: skip


class SyncBatchNorm(SyncNorm):
    """Batch normalization over the batches of every process of `process_set`, for
    inputs of shape (N, C, ...). One process alone behaves as a plain BatchNorm.

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

    def exchange(self) -> Exchange | None:
        alone = (
            basics.size() == 1 or len(process_sets.members(self.process_set, "SyncBatchNorm")) == 1
        )
        return None if alone else _ProcessSetExchange(self.process_set)
