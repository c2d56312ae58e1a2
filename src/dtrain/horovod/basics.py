"""Horovod's basics: `init`, `shutdown`, who am I (`rank`, `size`, `local_rank`, ...) and
what is built (`gloo_built`, `nccl_built`, ...).

`init()` joins the default torch.distributed process group from the variables that
`horovodrun` or `dtrain run` set (RANK, WORLD_SIZE, LOCAL_RANK, ..., or Horovod's own
HOROVOD_RANK, HOROVOD_SIZE, ...), or adopts the group the script already initialised.
Run with plain ``python script.py`` it forms a one-process group, as Horovod does. Horovod's
API is global state by design; it lives in one `Context` here, set by `init` and cleared by
`shutdown`.
"""

from __future__ import annotations

import atexit
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.horovod.errors import HorovodUsageError, NotInitializedError, UnsupportedError
from dtrain.topology import Topology, init_process_group

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
        joins: `join()` calls so far (every rank counts the same).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    devices: dict[str, str]
    owns_group: bool
    joins: int = 0


_CONTEXT: Context | None = None
_EXIT_HOOKED = False


def context(what: str) -> Context:
    """The job's Context; `what` (the calling function's name) goes into the error raised
    before `init()`."""
    if _CONTEXT is None:
        raise NotInitializedError(what)
    return _CONTEXT


def _env_int(names: tuple[str, ...], default: int) -> int:
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


def _timeout_s(config: Config | None) -> float:
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


def _backend(config: Config | None) -> str:
    """gloo for CPU tensors, and NCCL for CUDA tensors where there are GPUs: Horovod reduces
    tensors wherever they live, and one group with both backends does too."""
    if torch.cuda.is_available() and dist.is_nccl_available() and not (config and config.cpu):
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _devices() -> dict[str, str]:
    """device type -> backend, from the default group's backend config ("cpu:gloo,...")."""
    text = str(dist.get_backend_config())
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    devices = {device.strip(): backend.strip() for device, backend in pairs}
    return devices or {"cpu": str(dist.get_backend())}


def init(comm: object = None, process_sets: object = None) -> None:
    """Join (or form) the job's process group; a second call does nothing.

    Args:
        comm: Horovod's MPI communicator or list of ranks; refused (dtrain has no MPI).
        process_sets: Horovod's process sets to create at start; refused in this version.
    """
    global _CONTEXT, _EXIT_HOOKED
    if comm is not None:
        raise UnsupportedError(
            "hvd.init(comm=...) picks ranks through MPI, which dtrain does not use; call "
            "hvd.init() without comm: every process horovodrun starts takes part."
        )
    if process_sets is not None:
        raise UnsupportedError(
            "Process sets (hvd.init(process_sets=...)) are not supported yet; call hvd.init() "
            "without them and run collectives over all processes."
        )
    if _CONTEXT is not None:
        return
    rank, size = _env_int(("RANK", "HOROVOD_RANK"), 0), _env_int(("WORLD_SIZE", "HOROVOD_SIZE"), 1)
    owns_group = not dist.is_initialized()
    if owns_group:
        _start_group(rank, size)
    else:
        rank, size = dist.get_rank(), dist.get_world_size()
    local_rank, local_size, cross_rank, cross_size = placement(rank, size)
    _CONTEXT = Context(
        rank, size, local_rank, local_size, cross_rank, cross_size, _devices(), owns_group
    )
    export_environment(_CONTEXT)
    if not _EXIT_HOOKED:  # Horovod shuts down at exit too; once is enough
        atexit.register(shutdown)
        _EXIT_HOOKED = True


def placement(rank: int, size: int) -> tuple[int, int, int, int]:
    """(local_rank, local_size, cross_rank, cross_size) of global `rank` in a job of
    `size`, from the launcher's variables (torchrun's, then Horovod's); a job without them
    is taken to run on one machine."""
    local_size = max(1, _env_int(("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"), size))
    local_rank = _env_int(("LOCAL_RANK", "HOROVOD_LOCAL_RANK"), rank % local_size)
    cross_size = _env_int(("GROUP_WORLD_SIZE", "HOROVOD_CROSS_SIZE"), -(-size // local_size))
    cross_rank = _env_int(("GROUP_RANK", "HOROVOD_CROSS_RANK"), rank // local_size)
    return local_rank, local_size, cross_rank, cross_size


def _start_group(rank: int, size: int) -> None:
    if size > 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        raise HorovodUsageError(
            f"This process is rank {rank} of {size}, but no rendezvous address is set "
            "(MASTER_ADDR, MASTER_PORT); start the script with `horovodrun -np N python "
            "script.py` or `dtrain run --nproc N script.py`, which set it."
        )
    if not 0 <= rank < size:
        raise HorovodUsageError(
            f"The environment gives rank {rank} for a job of {size} process(es); start the "
            "script with horovodrun, which sets both."
        )
    config = Config.from_env()
    local_rank, local_size, _, _ = placement(rank, size)
    # Horovod scripts pin their GPU themselves (torch.cuda.set_device(hvd.local_rank()))
    # after init, so the group is created lazily for CUDA: no device is bound here.
    topology = Topology(rank, size, local_rank, local_size, torch.device("cpu"), _backend(config))
    init_process_group(topology, _timeout_s(config))


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


def shutdown() -> None:
    """Leave the job: destroy the process group `init` created (one the script created
    itself is left alone). Nothing happens before `init`; `init` may be called again."""
    global _CONTEXT
    ctx, _CONTEXT = _CONTEXT, None
    if ctx is not None and ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


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


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline is not recorded yet; this warns and carries on."""
    warnings.warn(
        f"hvd.start_timeline({file_path!r}) records nothing yet: dtrain has no Horovod "
        "timeline. The script goes on; remove the call to silence this warning.",
        stacklevel=2,
    )


def stop_timeline() -> None:
    """Counterpart of `start_timeline`; does nothing."""
