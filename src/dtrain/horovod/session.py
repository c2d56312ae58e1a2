"""`hvd.init` and `hvd.shutdown`: join (or form) the job's process group, then start
what Horovod runs beside it: the data process groups, the negotiation's control channel
and thread, and the registered process sets.

`init()` joins the default torch.distributed process group from the variables that
`horovodrun` or `dtrain run` set (RANK, WORLD_SIZE, ..., or Horovod's HOROVOD_RANK,
HOROVOD_SIZE, ...), or adopts the group the script already initialised; run with plain
``python script.py`` it forms a one-process group, as Horovod does. Horovod's collectives
run on groups of their own, so the script's own torch.distributed calls on the default
group never interleave with them.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.horovod import basics, timeline
from dtrain.horovod import channel as control
from dtrain.horovod.basics import Context
from dtrain.horovod.channel import Channel
from dtrain.horovod.errors import HorovodUsageError, UnsupportedError
from dtrain.horovod.execute import Executor
from dtrain.horovod.negotiation import Negotiation
from dtrain.horovod.process_sets import ProcessSet, Registry, dynamic_requested, setup
from dtrain.process import teardown
from dtrain.process.topology import Topology, init_process_group

FUSION_VAR = "HOROVOD_FUSION_THRESHOLD"
STALL_WARN_VAR = "HOROVOD_STALL_CHECK_TIME_SECONDS"
STALL_OFF_VAR = "HOROVOD_STALL_CHECK_DISABLE"
STALL_FAIL_VAR = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024
_EXIT_HOOKED = False


@dataclass
class _Rendezvous:
    """Where this process's groups meet: the store of the first group `init` formed, kept
    for the life of the process (rank 0 serves it) so that an `init` after `shutdown`
    meets the others there again.

    Attributes:
        job: (MASTER_ADDR, MASTER_PORT, rank, size) the store was formed for; an `init`
            under other variables forms a group of its own afresh.
        store: the job's store.
        groups: the groups formed in it so far (every process of the job forms as many,
            as Horovod's init and shutdown are called alike everywhere).
    """

    job: tuple[str, str, int, int]
    store: dist.Store
    groups: int = 1


_RENDEZVOUS: _Rendezvous | None = None


def init(comm: object = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join (or form) the job's process group and start Horovod's negotiation; a second
    call does nothing.

    Args:
        comm: Horovod's MPI communicator or list of ranks; refused (dtrain has no MPI).
        process_sets: static process sets to register (a list of `hvd.ProcessSet`, the
            same on every process), or "dynamic" to allow `hvd.add_process_set` later.
    """
    global _EXIT_HOOKED
    if comm is not None:
        raise UnsupportedError(
            "hvd.init(comm=...) picks ranks through MPI, which dtrain does not use; call "
            "hvd.init() without comm: every process horovodrun starts takes part."
        )
    if basics.is_initialized():
        return
    static = [] if process_sets is None or process_sets == "dynamic" else list(process_sets)
    env_rank = basics.env_int(("RANK", "HOROVOD_RANK"), 0)
    env_size = basics.env_int(("WORLD_SIZE", "HOROVOD_SIZE"), 1)
    config = Config.from_env()
    owns_group = not dist.is_initialized()
    if owns_group:
        _start_group(env_rank, env_size, config)
    rank, size = dist.get_rank(), dist.get_world_size()
    ctx = Context(rank, size, *basics.placement(rank, size), basics.devices(), owns_group)
    _start_negotiation(ctx, basics.timeout_s(config), dynamic_requested(process_sets))
    basics.set_context(ctx)
    basics.export_environment(ctx)
    setup(ctx.sets, static)
    if not _EXIT_HOOKED:  # Horovod shuts down at exit too; once is enough
        atexit.register(shutdown)
        _EXIT_HOOKED = True
    # dtrain's launcher ends its workers with os._exit, past atexit: it closes what the
    # teardown registry holds instead.
    teardown.close_at_exit(_AT_EXIT)


def _start_group(rank: int, size: int, config: Config) -> None:
    global _RENDEZVOUS
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
    job = (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank, size)
    if _RENDEZVOUS is not None and _RENDEZVOUS.job == job:
        _form_again(_RENDEZVOUS, config)
        return
    local_rank, local_size, _, _ = basics.placement(rank, size)
    # Horovod scripts pin their GPU themselves (torch.cuda.set_device(hvd.local_rank()))
    # after init, so the group is created lazily for CUDA: no device is bound here.
    topology = Topology(
        rank, size, local_rank, local_size, torch.device("cpu"), basics.backend(config)
    )
    init_process_group(topology, basics.timeout_s(config))
    _RENDEZVOUS = _Rendezvous(job, dist.distributed_c10d._get_default_store())


def _form_again(rendezvous: _Rendezvous, config: Config) -> None:
    """Form the job's group again after `shutdown`, in the store the first group met in,
    under a prefix of this group's own. A fresh store on the same port would not do: a
    rank that got there before rank 0 closed the old one would read the last group's
    keys, and the closed addresses they hold (the connection is refused, and every rank
    then waits in the rendezvous)."""
    _, _, rank, size = rendezvous.job
    store = dist.PrefixStore(f"dtrain/horovod/group-{rendezvous.groups}", rendezvous.store)
    rendezvous.groups += 1
    dist.init_process_group(
        basics.backend(config),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=basics.timeout_s(config)),
    )


def _env_number(name: str, default: float, example: str) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return max(0.0, float(text))
    except ValueError:
        raise HorovodUsageError(
            f"{name}={text!r} is not a number; set it to e.g. {example}, or unset it."
        ) from None


def _stall_limits(timeout_s: float) -> tuple[float, float | None]:
    """(seconds before an operation nobody else issued fails, seconds before a warning):
    Horovod's stall check variables; the failure defaults to the collective timeout."""
    fail = _env_number(STALL_FAIL_VAR, 0.0, "60") or timeout_s
    off = os.environ.get(STALL_OFF_VAR, "0").strip() not in ("", "0")
    return fail, None if off else _env_number(STALL_WARN_VAR, 60.0, "60")


def _start_negotiation(ctx: Context, timeout_s: float, dynamic: bool) -> None:
    """Create the data group, the control channel, the executor and the engine (every
    process calls this in the same order: group creation is collective)."""
    timeout = timedelta(seconds=timeout_s)
    data = dist.new_group(timeout=timeout)
    channel = None
    if ctx.size > 1:
        if ctx.size > control.STORE_GATHER_MAX:
            ctx.control_group = dist.new_group(backend="gloo", timeout=timeout)
        # torch offers the job's store to process groups only; the negotiation rings its
        # doorbell there, as `join` counted arrivals there before.
        store = dist.distributed_c10d._get_default_store()
        session = (store.add("dtrain/horovod/sessions", 1) - 1) // ctx.size
        channel = Channel(store, ctx.control_group, ctx.rank, ctx.size, session)
        ctx.store, ctx.session = store, session
    ctx.sets = Registry(ctx.rank, ctx.size, data, dynamic)
    fusion = int(_env_number(FUSION_VAR, DEFAULT_FUSION_BYTES, "67108864 (64 MiB)"))
    ctx.executor = Executor(ctx.rank, ctx.devices, ctx.sets.group_of, fusion)
    fail_s, warn_s = _stall_limits(timeout_s)
    run, plan = ctx.executor.run, ctx.executor.plan
    ctx.engine = Negotiation(ctx.rank, ctx.size, channel, run, plan, fail_s, warn_s)
    ctx.engine.timeline = timeline.from_environment(ctx.rank)


class _ShutdownAtExit:
    """What dtrain's teardown registry closes at the end of a launched worker."""

    def close(self, *, failed: bool = False) -> None:
        """Shut down, unless the process ends on an error: then the others may be gone,
        and the launcher stops them anyway, so nothing waits for them."""
        if not failed:
            shutdown()


_AT_EXIT = _ShutdownAtExit()


def shutdown() -> None:
    """Leave the job: tell the other processes, stop the negotiation, destroy the groups
    `init` created (one the script created itself is left alone). Nothing happens before
    `init`; `init` may be called again."""
    ctx = basics.set_context(None)
    if ctx is None:
        return
    teardown.forget(_AT_EXIT)
    timeline.stop(ctx)
    stopped = ctx.engine.close()
    if not stopped:
        return  # a peer is gone mid-round: leave the groups to the end of the process
    if dist.is_initialized():
        ctx.sets.destroy()
        if ctx.control_group is not None:
            dist.destroy_process_group(ctx.control_group)
        if ctx.owns_group:
            dist.destroy_process_group()
