"""Who am I: rank, world size, device and backend of this process.

One explicit :class:`Topology` object is built by `dtrain.init()` and passed to whatever
needs it; there is no module-level distributed state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.process import torch_version  # noqa: F401 - refuses too old a torch before it is used


@dataclass(frozen=True)
class Topology:
    """The place of this process in the job.

    Attributes:
        rank: global rank of this process, in [0, world_size).
        world_size: number of processes in the job.
        local_rank: rank among the processes of this machine.
        local_world_size: processes on this machine.
        device: the device this process computes on (``cuda:LOCAL_RANK`` or ``cpu``).
        backend: ``nccl`` on GPUs, ``gloo`` on CPU.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes checkpoints."""
        return self.rank == 0


def mask_devices(devices: list[int] | None) -> None:
    """Restrict this process (and its children) to `devices` via CUDA_VISIBLE_DEVICES.

    Must run before CUDA is first used; later calls cannot change what CUDA sees.
    """
    if devices is None:
        return
    wanted = ",".join(str(d) for d in devices)
    if torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != wanted:
        raise ConfigError(
            "--devices must be set before CUDA is initialised; pass it to `dtrain run` or "
            "call dtrain.init(devices=...) before any tensor is placed on a GPU."
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted


def use_gpus(config: Config) -> bool:
    """Whether this job computes on GPUs: some are visible and --cpu was not given."""
    return not config.cpu and torch.cuda.is_available()


def detect(config: Config) -> Topology:
    """Build the topology from the environment `dtrain run` (or torchrun) set, or as a
    single process when run directly with ``python script.py``."""
    mask_devices(config.devices)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if use_gpus(config):
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise ConfigError(
                f"This machine runs {local_world_size} processes but only {visible} GPU(s) "
                "are visible; lower --nproc to at most the number of GPUs, widen --devices, "
                "or pass --cpu to run on the CPU."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    return Topology(rank, world_size, local_rank, local_world_size, device, backend)


def init_process_group(topology: Topology, timeout_s: float) -> None:
    """Join the process group of the job (env:// rendezvous set by the launcher).

    A one-process job started without a launcher gets a private in-memory store, so
    multi-process strategies also run with ``python script.py``.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        try:
            dist.init_process_group(
                topology.backend,
                store=_job_store(topology, timeout),
                rank=topology.rank,
                world_size=topology.world_size,
                timeout=timeout,
                device_id=topology.device if topology.backend == "nccl" else None,
            )
        except RuntimeError as e:
            if "connectFullMesh" not in str(e):
                raise
            raise ConfigError(_peers_unreachable(topology, str(e))) from None
    else:
        dist.init_process_group(
            topology.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


def _peers_unreachable(topology: Topology, error: str) -> str:
    """gloo could not connect this rank to every other one: a rank advertised an address
    that another cannot reach (usually the wrong network interface)."""
    detail = error.strip().splitlines()[0].split("] ", 1)[-1]
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    using = f"interface {named}" if named else "the address this machine's hostname resolves to"
    return (
        f"Rank {topology.rank} could not connect to every other rank of the job ({detail}); "
        f"this machine offered them {using}. Every machine must use an interface the "
        "others can reach: drop --iface (and GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) to "
        "let dtrain pick the one that routes to --master, or name the right one with --iface."
    )


def _job_store(topology: Topology, timeout: timedelta) -> dist.Store:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT, private to this attempt and to
    this process's join there (`_STORES`).

    The agent hosts the store when it says so (TORCHELASTIC_USE_AGENT_STORE); the store
    then outlives a restart, and a restarted group reading the previous attempt's keys (a
    dead rank's address) fails to connect now and then, so a prefix per attempt
    (TORCHELASTIC_RESTART_COUNT) keeps the attempts apart. Otherwise rank 0 hosts a fresh
    store every attempt, and no prefix is needed: none is used, since a machine that
    joins an elastic job late counts its attempts from 0 while the others do not.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    store, joins = _STORES.get(where, (None, 0))
    if store is None:
        store = dist.TCPStore(
            *where,
            topology.world_size,
            is_master=not agent_hosts and topology.rank == 0,
            timeout=timeout,
        )
    _STORES[where] = (store, joins + 1)
    if joins:  # this process joined a group there before (dtrain.init after a close)
        store = dist.PrefixStore(f"dtrain/join-{joins}", store)
    if not agent_hosts:
        return store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"dtrain/attempt-{attempt}", store)


_STORES: dict[tuple[str, int], tuple[dist.Store, int]] = {}
"""The store this process reached at each address, and how many groups it joined there.
A group left (`engine.close`) can leave objects that still hold the store, whose socket
then stays bound: a second `dtrain.init` in the same process (a notebook, a script that
retries after a refusal) would fail to listen on the same port, so it takes the same
store again, its keys under a prefix of that join's own (every rank joins in the same
order), apart from the last group's."""
