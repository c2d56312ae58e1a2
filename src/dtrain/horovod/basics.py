"""Horovod's basics: who am I (`rank`, `size`, `local_rank`, ...), what is built
(`gloo_built`, `nccl_built`, ...), and the job's `Context`.

Horovod's API is global state by design; it lives in one `Context` here, set by
`hvd.init` and cleared by `hvd.shutdown` (both in `session.py`), with the helpers they use
to read the launcher's variables.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.horovod.errors import HorovodUsageError, NotInitializedError

TIMEOUT_VAR = "HOROVOD_GLOO_TIMEOUT_SECONDS"
"""Seconds a collective may wait (Horovod's own variable; `horovodrun --gloo-timeout-seconds`)."""


@dataclass
class Context:
    """This process's place in the Horovod job, fixed at `init()`.

    Attributes:
        rank, size: global rank and number of processes.
        local_rank, local_size: rank among, and number of, the processes of this machine.
        cross_rank, cross_size: index of this machine, and number of machines.
        devices: device type -> backend of the process group ("cpu" -> "gloo", ...);
            tensors on other devices are staged through one the group handles.
        owns_group: True if `init` created the process group (and `shutdown` destroys it).
        engine: the negotiation engine (`negotiation.Negotiation`) operations are submitted to.
        executor: what starts negotiated operations (`execute.Executor`).
        sets: the registered process sets (`process_sets.Registry`).
        control_group: the gloo group the negotiation runs on (None for one process).
        counters: this process's unnamed operations so far, by kind and process set.
        store, session: the job's store and this `init`'s number in it (None and 0 for
            one process); keys of this session carry the number.
        timelines: how many timelines this process has stopped (numbers their keys).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    devices: dict[str, str]
    owns_group: bool
    engine: Any = None
    executor: Any = None
    sets: Any = None
    control_group: Any = None
    counters: dict = field(default_factory=dict)
    store: Any = None
    session: int = 0
    timelines: int = 0


_CONTEXT: Context | None = None


def set_context(ctx: Context | None) -> Context | None:
    """Install `ctx` as the job's Context (None clears it); return the one it replaces."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    return previous


def context(what: str) -> Context:
    """The job's Context; `what` (the calling function's name) goes into the error raised
    before `init()`."""
    if _CONTEXT is None:
        raise NotInitializedError(what)
    return _CONTEXT


def env_int(names: tuple[str, ...], default: int) -> int:
    """The first of the variables `names` that is set, as an int; else `default`."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            try:
                return int(value)
            except ValueError:
                raise HorovodUsageError(
                    f"The environment variable {name}={value!r} is not an integer; unset it or "
                    "start the script with horovodrun, which sets it."
                ) from None
    return default


def timeout_s(config: Config | None) -> float:
    """Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS, else dtrain's --timeout, else 600 s."""
    text = os.environ.get(TIMEOUT_VAR)
    if text:
        try:
            return float(text)
        except ValueError:
            raise HorovodUsageError(
                f"{TIMEOUT_VAR}={text!r} is not a number of seconds; set it to e.g. 600."
            ) from None
    return config.timeout_s if config is not None else 600.0


def backend(config: Config | None) -> str:
    """gloo for CPU tensors, and NCCL for CUDA tensors where there are GPUs: Horovod reduces
    tensors wherever they live, and one group with both backends does too."""
    if torch.cuda.is_available() and dist.is_nccl_available() and not (config and config.cpu):
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def devices() -> dict[str, str]:
    """device type -> backend, from the default group's backend config ("cpu:gloo,...")."""
    text = str(dist.get_backend_config())
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    devices = {device.strip(): backend.strip() for device, backend in pairs}
    return devices or {"cpu": str(dist.get_backend())}


def placement(rank: int, size: int) -> tuple[int, int, int, int]:
    """(local_rank, local_size, cross_rank, cross_size) of global `rank` in a job of
    `size`, from the launcher's variables (torchrun's, then Horovod's); a job without them
    is taken to run on one machine."""
    local_size = max(1, env_int(("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"), size))
    local_rank = env_int(("LOCAL_RANK", "HOROVOD_LOCAL_RANK"), rank % local_size)
    cross_size = env_int(("GROUP_WORLD_SIZE", "HOROVOD_CROSS_SIZE"), -(-size // local_size))
    cross_rank = env_int(("GROUP_RANK", "HOROVOD_CROSS_RANK"), rank // local_size)
    return local_rank, local_size, cross_rank, cross_size


def export_environment(ctx: Context) -> None:
    """Set HOROVOD_RANK, HOROVOD_SIZE, ... in this process, as horovodrun's workers see them
    (a script started by `dtrain run` gets them here, at `init`)."""
    set_environment(
        ctx.rank, ctx.size, ctx.local_rank, ctx.local_size, ctx.cross_rank, ctx.cross_size
    )


def set_environment(
    rank: int, size: int, local_rank: int, local_size: int, cross_rank: int, cross_size: int
) -> None:
    """Write Horovod's per-process variables (HOROVOD_RANK, ...) into os.environ."""
    os.environ.update(
        HOROVOD_RANK=str(rank),
        HOROVOD_SIZE=str(size),
        HOROVOD_LOCAL_RANK=str(local_rank),
        HOROVOD_LOCAL_SIZE=str(local_size),
        HOROVOD_CROSS_RANK=str(cross_rank),
        HOROVOD_CROSS_SIZE=str(cross_size),
    )
    os.environ.setdefault("HOROVOD_HOSTNAME", socket.gethostname())


def is_initialized() -> bool:
    """True between `init()` and `shutdown()`."""
    return _CONTEXT is not None


def rank() -> int:
    """This process's global rank, in [0, size())."""
    return context("rank").rank


def size() -> int:
    """The number of processes in the job."""
    return context("size").size


def local_rank() -> int:
    """This process's rank among the processes of its machine (the GPU to pin)."""
    return context("local_rank").local_rank


def local_size() -> int:
    """The number of processes on this machine."""
    return context("local_size").local_size


def cross_rank() -> int:
    """The index of this machine among the job's machines."""
    return context("cross_rank").cross_rank


def cross_size() -> int:
    """The number of machines in the job."""
    return context("cross_size").cross_size


def is_homogeneous() -> bool:
    """True if every machine runs the same number of processes."""
    ctx = context("is_homogeneous")
    return ctx.size == ctx.local_size * ctx.cross_size


def mpi_built() -> bool:
    """False: dtrain runs on torch.distributed, without MPI."""
    return False


def mpi_enabled() -> bool:
    """False: dtrain runs on torch.distributed, without MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI underneath."""
    return False


def gloo_built() -> bool:
    """True if this torch has the gloo backend (the CPU collectives)."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """True if this torch has the gloo backend, which every dtrain job uses on CPU."""
    return dist.is_gloo_available()


def nccl_built() -> bool:
    """True if this torch has NCCL and sees a GPU (CUDA tensors then go through NCCL)."""
    return dist.is_nccl_available() and torch.cuda.is_available()


def cuda_built() -> bool:
    """True if this torch is a CUDA build."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """True if this torch is a ROCm build."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False
