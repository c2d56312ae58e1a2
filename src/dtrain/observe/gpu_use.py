"""Whether every GPU of the job really works: what ``watch nvidia-smi`` shows, measured.

A program sees every visible GPU but computes only on those it is told to use; the others
idle. Each rank samples, in a daemon thread from setup to close, how busy the GPUs it
computes on are: NVML's utilisation, the share of the last sample period in which a kernel
ran (`torch.cuda.utilization`, which needs the ``nvidia-ml-py`` package; without it there
are no samples). At the end every rank says which of its machine's visible GPUs it used;
the main rank prints each rank's mean and names the visible GPUs no process computed on.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtrain.observe.events import End, Observer, Run
from dtrain.process.collectives import gather_to_main
from dtrain.process.logs import LOGGER

SAMPLE_S = 0.5
"""Seconds between two samples of the GPUs' utilisation (nvidia-smi's own period is 1/6 s
to 1 s, by device)."""

STOP_S = 5.0
"""Seconds `engine.close` waits for a reading in flight before it goes on without it."""

Reader = Callable[[int], int]
"""The utilisation of the visible GPU of this index, in percent."""


def nvml_reader() -> Reader | None:
    """`torch.cuda.utilization` where NVML answers on this machine; None where it cannot
    (no GPU, or no ``nvidia-ml-py``)."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.utilization(0)
    except Exception:  # noqa: BLE001 - any failure means: no readings here
        return None
    return torch.cuda.utilization


class Sampler:
    """Reads the utilisation of `indices` every `period` seconds in a daemon thread until
    `stop`; a failed read ends the sampling, keeping what was read."""

    def __init__(self, indices: list[int], read: Reader, period: float = SAMPLE_S) -> None:
        self.sums = dict.fromkeys(indices, 0)
        self.counts = dict.fromkeys(indices, 0)
        self._read = read
        self._period = period
        self._failed = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtrain-gpu-use", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._period) and self._sample():
            pass

    def _sample(self) -> bool:
        """Read every GPU once; False (and no more sampling) where a read failed."""
        if self._failed:
            return False
        try:
            for index in self.sums:
                self.sums[index] += int(self._read(index))
                self.counts[index] += 1
        except Exception as e:  # noqa: BLE001 - the run goes on without readings
            LOGGER.warning("GPU utilisation could not be read (%s); sampling stops", e)
            self._failed = True
        return not self._failed

    def stop(self) -> dict[int, float]:
        """Stop sampling, with one last reading (so a run shorter than a period has one);
        the mean utilisation of each GPU that was read at least once. A read that hangs
        (a GPU fallen off the bus) is left behind, never waited for."""
        self._done.set()
        self._thread.join(timeout=STOP_S)
        if not self._thread.is_alive():
            self._sample()
        return {i: self.sums[i] / n for i, n in self.counts.items() if n}


class GpuUse(Observer):
    """Samples the GPUs this process computes on (`devices`) over the run; at its end,
    the main rank says how busy each rank's GPUs were and which visible GPUs idled."""

    def __init__(
        self,
        devices: tuple[torch.device, ...],
        is_main: bool,
        more_flags: str = "--nproc",
        read: Reader | None = None,
        period: float = SAMPLE_S,
    ) -> None:
        self.more_flags = more_flags
        """The flags that give the job more GPUs, for the note on idle ones."""
        self.indices = sorted({_index(d) for d in devices if d.type == "cuda"})
        self.is_main = is_main
        self._read = read
        self._period = period
        self._sampler: Sampler | None = None
        self._group: dist.ProcessGroup | None = None

    def on_setup(self, run: Run) -> None:
        self._group = run.group
        read = self._read or (nvml_reader() if self.indices else None)
        if read is not None and self.indices:
            self._sampler = Sampler(self.indices, read, self._period)

    def on_close(self, end: End) -> None:
        busy = self._sampler.stop() if self._sampler is not None else {}
        self._sampler = None
        if not end.together:  # the gather needs every rank
            return
        mine = {
            "host": socket.gethostname(),
            "visible": _visible_ids(),
            "used": self.indices,
            "busy": busy,
        }
        everyone = gather_to_main(mine, self._group)
        if not self.is_main or everyone is None:
            return
        lines, results = report(everyone, self.more_flags)
        for line in lines:
            LOGGER.info(line)
            print(line, flush=True)
        end.results.update(results)


def report(
    everyone: list[dict[str, Any]], more_flags: str = "--nproc"
) -> tuple[list[str], dict[str, Any]]:
    """What the main rank says, and adds to the metrics JSON, from every rank's record
    (``host``, ``visible``: the ids of the GPUs it saw, ``used``: the indices among them it
    computed on, ``busy``: index -> mean utilisation); `more_flags` give the job more
    GPUs (``--towers`` for towers, ``--strategy ddp --nproc`` for one-process ones)."""
    lines: list[str] = []
    results: dict[str, Any] = {}
    if any(r["busy"] for r in everyone):
        results["gpu_busy_percent"] = [
            {_id(r, i): round(p, 1) for i, p in r["busy"].items()} or None for r in everyone
        ]
        shown = ", ".join(
            f"rank {rank} "
            + ", ".join(
                f"{p:.0f}%" if len(r["busy"]) == 1 else f"GPU {_id(r, i)} {p:.0f}%"
                for i, p in r["busy"].items()
            )
            for rank, r in enumerate(everyone)
            if r["busy"]
        )
        lines.append(
            f"dtrain: GPU busy (share of the time a kernel ran, NVML, mean over the run): {shown}."
        )
    idle = idle_gpus(everyone)
    if idle:
        results["idle_gpus"] = {host: i.idle for host, i in idle.items()}
    for host, i in idle.items():
        # --devices takes indices; CUDA_VISIBLE_DEVICES may name GPUs by UUID instead.
        hide = (
            f"--devices {','.join(i.used)} shows the job only the GPUs it uses"
            if all(gpu.isdigit() for gpu in i.used)
            else "name only the GPUs it uses in CUDA_VISIBLE_DEVICES"
        )
        lines.append(
            f"dtrain: note: GPU(s) {', '.join(i.idle)} of {host} are visible but no process "
            f"computed on them. Give them work ({more_flags} {i.visible}), or leave them to "
            f"other jobs: {hide}."
        )
    return lines, results


def _id(record: dict[str, Any], index: int) -> str:
    """The id of the visible GPU `index` of a rank's record (as the idle note names it)."""
    visible = record["visible"]
    return visible[index] if index < len(visible) else str(index)


@dataclass(frozen=True)
class Idle:
    """A machine's GPUs that no process of the job computed on."""

    idle: list[str]
    """Their ids (CUDA_VISIBLE_DEVICES's entries where it is set)."""
    used: list[str]
    """The ids of the GPUs the job used there."""
    visible: int
    """How many GPUs the machine's processes see."""


def idle_gpus(everyone: list[dict[str, Any]]) -> dict[str, Idle]:
    """By machine on which the job computed on some GPU but left some visible GPU idle:
    which, from every rank's record (see `report`)."""
    hosts: dict[str, tuple[list[str], set[int]]] = {}
    for r in everyone:
        visible, used = hosts.setdefault(r["host"], (r["visible"], set()))
        used.update(r["used"])
    found = {}
    for host, (visible, used) in hosts.items():
        idle = [gpu for i, gpu in enumerate(visible) if i not in used]
        if used and idle:
            taken = [gpu for i, gpu in enumerate(visible) if i in used]
            found[host] = Idle(idle, taken, len(visible))
    return found


def _visible_ids() -> list[str]:
    """The ids of the GPUs this process sees, in index order: CUDA_VISIBLE_DEVICES's
    entries where it is set, else 0, 1, ..."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    masked = os.environ.get("CUDA_VISIBLE_DEVICES")
    if masked:
        entries = [e.strip() for e in masked.split(",") if e.strip()]
        if len(entries) >= count:
            return entries[:count]
    return [str(i) for i in range(count)]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
