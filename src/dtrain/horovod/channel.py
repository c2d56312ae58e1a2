"""The control channel the negotiation runs on: a doorbell and, for jobs of up to
`STORE_GATHER_MAX` processes, the exchange itself, in the job's store; larger jobs exchange
on a gloo group of their own.

Rounds are numbered alike on every process. A process with something new to announce
rings round n (sets a key in the store); every process's negotiation thread waits for that
key, so all of them enter round n's exchange together, and nobody spends CPU while nothing
is issued (Horovod's background loop instead wakes every cycle time). In the store, each
process sets its announcements under a key of its own and reads everyone's at once (the
read waits for the missing keys): a round costs a few store round trips, about a quarter of
a gloo all-gather's latency on 2 processes here. With more processes, the store server would
carry every process's copy of every announcement, so they all-gather instead: a fixed-size
buffer that holds a round in the common case, and a second all-gather sized to the largest
when one does not fit.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

CAPACITY = 4096
"""Bytes each process sends in the first all-gather of a round (8 of them the length)."""

STORE_GATHER_MAX = 16
"""Largest job whose rounds are exchanged through the store rather than gloo."""

_IDLE = timedelta(days=7)
"""How long a negotiation thread waits for the next round: as long as it takes (the store's
own timeout would end an idle job's wait, and each expiry logs a warning)."""


class Channel:
    """Doorbell and all-gather for one Horovod session (one `hvd.init()`).

    Args:
        store: the job's store (the negotiation takes two connections of its own, one to
            ring from the calling threads and one for the negotiation thread).
        group: a gloo process group over every rank, used only for the negotiation; None
            to exchange through the store (jobs of up to `STORE_GATHER_MAX` processes).
        rank, size: this process's rank and the job's size.
        session: a number every process of this `init` shares, keeping rounds of an
            earlier session in the same store apart.
    """

    def __init__(
        self,
        store: dist.Store,
        group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        session: int,
    ) -> None:
        self._ringer = store.clone()
        self._waiter = store.clone()
        self._group = group
        self._rank = rank
        self._size = size
        self._prefix = f"dtrain/horovod/{session}/round/"
        self._said = f"dtrain/horovod/{session}/said/"

    def ring(self, round_: int) -> None:
        """Ask every process to run round `round_` (ringing twice is harmless)."""
        self._ringer.set(self._prefix + str(round_), b"1")

    def wait(self, round_: int) -> None:
        """Block until some process rang round `round_`."""
        self._waiter.wait([self._prefix + str(round_)], _IDLE)

    def forget(self, round_: int) -> None:
        """Drop round `round_`'s key once every process is past waiting for it (called
        after its all-gather, which every process entered after its wait)."""
        if self._rank == 0:
            self._waiter.delete_key(self._prefix + str(round_))

    def gather(self, round_: int, payload: bytes) -> list[bytes]:
        """Every process's `payload` for round `round_`, in rank order."""
        if self._group is None:
            return self._gather_in_store(round_, payload)
        return self._all_gather(payload)

    def _gather_in_store(self, round_: int, payload: bytes) -> list[bytes]:
        self._waiter.set(f"{self._said}{round_}/{self._rank}", payload)
        said = self._waiter.multi_get([f"{self._said}{round_}/{r}" for r in range(self._size)])
        if round_:
            # Everyone set this round's key after reading the last: nobody needs ours now.
            self._waiter.delete_key(f"{self._said}{round_ - 1}/{self._rank}")
        return [bytes(s) for s in said]

    def _all_gather(self, payload: bytes) -> list[bytes]:
        buffer = torch.zeros(CAPACITY, dtype=torch.uint8)
        buffer[:8] = _bytes(len(payload).to_bytes(8, "little"))
        if len(payload) <= CAPACITY - 8:
            buffer[8 : 8 + len(payload)] = _bytes(payload)
        rows = [torch.empty_like(buffer) for _ in range(self._size)]
        dist.all_gather(rows, buffer, group=self._group)
        lengths = [int.from_bytes(row[:8].numpy().tobytes(), "little") for row in rows]
        if max(lengths) <= CAPACITY - 8:
            return [row[8 : 8 + n].numpy().tobytes() for row, n in zip(rows, lengths, strict=True)]
        # Someone's round did not fit: everyone sends in full, padded to the largest.
        full = torch.zeros(max(lengths), dtype=torch.uint8)
        full[: len(payload)] = _bytes(payload)
        rows = [torch.empty_like(full) for _ in range(self._size)]
        dist.all_gather(rows, full, group=self._group)
        return [row[:n].numpy().tobytes() for row, n in zip(rows, lengths, strict=True)]


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
