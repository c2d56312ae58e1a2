"""Horovod's PyTorch API (``horovod.torch``) on dtrain's process groups.

`import horovod.torch as hvd` gives this module (dtrain ships the alias), so Horovod
scripts run unchanged under ``horovodrun`` (dtrain's) or ``dtrain run``; started with
plain ``python script.py`` they run as one process, as under Horovod. See docs/horovod.md
for what is supported and what differs. Operations are negotiated by name between the
processes, as in Horovod (see `negotiation.py`).

A product: it enters the core through the public API and the doors
docs/architecture.md names (the launcher's runner, bootstrap and hosts, the topology, sync
batch norm, the trace, teardown).
"""

from __future__ import annotations

from dtrain.horovod import elastic
from dtrain.horovod.allgather import (
    allgather,
    allgather_async,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from dtrain.horovod.allreduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from dtrain.horovod.alltoall import alltoall, alltoall_async
from dtrain.horovod.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from dtrain.horovod.broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from dtrain.horovod.compression import Compression, Compressor
from dtrain.horovod.control import barrier, join
from dtrain.horovod.errors import HorovodInternalError
from dtrain.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from dtrain.horovod.handles import Handle, poll, synchronize
from dtrain.horovod.optimizer import DistributedOptimizer
from dtrain.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from dtrain.horovod.reducescatter import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from dtrain.horovod.reduction import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from dtrain.horovod.session import init, shutdown
from dtrain.horovod.sync_batch_norm import SyncBatchNorm
from dtrain.horovod.timeline import start_timeline, stop_timeline

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
