"""The machine the plan is for: cores, GPUs, memory per device, links between machines."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """What the cost model needs to know about the hardware besides the measured rates."""

    cores: int
    """CPU cores of one machine."""
    gpus: int
    """GPUs visible (0: the processes compute on the CPU)."""
    single_threads: int
    """Torch threads of a one-process run (the launcher leaves them as they are)."""
    memory_per_device: int
    """Bytes a rank may hold (a GPU's memory; on the CPU, the machine's memory)."""
    inter_node: tuple[float, float] = (1.25e9, 50e-6)
    """Bandwidth (bytes/s) and latency (s) of the links between machines: given, never
    measured (the planner runs on one machine)."""

    threads_per_process: int | None = None
    """OMP_NUM_THREADS when the environment sets it (the launcher keeps it)."""

    def threads(self, processes: int) -> int:
        """Torch threads of each of `processes` processes on one machine: the launcher's
        OMP_NUM_THREADS (the environment's, or cores / processes) on the CPU, 0 (left as
        they are) on GPUs."""
        if self.gpus:
            return 0
        return self.threads_per_process or max(1, self.cores // processes)

    def overlaps(self, processes: int) -> bool:
        """True if communication runs beside compute without slowing it: on GPUs (NCCL
        has engines of its own); on the CPU only with a spare core per process for
        gloo's copies (otherwise the same cores compute and copy, so the times add)."""
        return bool(self.gpus) or self.cores >= 2 * processes


def threads_from_env() -> int | None:
    """OMP_NUM_THREADS as a number, or None when unset or not a number."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container or `taskset`
    can allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def physical_memory() -> int:
    """Bytes of memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
