"""The messages between workers and servers, on gloo point-to-point send/recv.

Rank layout: roles.py (worker 0 is global rank 0 and writes checkpoints); messages name
workers by index in [0, W) and servers by index in [0, K). Every request is a fixed-size
float64 *header* sent on tag HEADER; a server receives headers from any source (gloo's
``recv`` without ``src``), reads the sender from the header, then receives the payload, if
any, from that sender on tag PAYLOAD. Replies go back on tag REPLY. Per (sender, tag) pair
gloo delivers in order, so a worker's payloads always follow their headers. Each training
run has a process group of its own for these messages (:class:`Channel`).

Pushed gradients need no header: they travel on a tag of their own per bucket (PUSH_TAGS
+ bucket index), and a server posts the receives of all a worker's next buckets when it
answers that worker's pull (and at start), so the buckets stream in as the worker sends
them (while backward completes them inside `engine.train_step`, at `optimizer.step()`
otherwise: client.py), in any order, straight into posted receives; the COMMIT that
follows them finds them in.

    header = [op, sender, a, b, c, the settings of every param group (GroupSettings)]

    COMMIT    a = version the gradients were computed on, b = clipping (0: none;
              sync: the bound on the round mean's global norm; async/ssp: the factor
              for this gradient), c = 1 if some parameter has no gradient: a uint8
              mask over the parameters (1: it has one) follows as payload; the pull
              of the next parameters, answered when the mode allows
                                                           reply: version, buckets
    PULL      the latest parameters now                    reply: version, buckets
    GET_STATE                                        reply: optimizer state (bytes)
    SET_STATE a = bytes                              payload: params + optimizer state
    STATS                                            reply: float64 counters
    PAUSE     the worker stops stepping for a while (evaluation, checkpoint, figures):
              sync rounds stop counting on its gradient until it sends RESUME
    FINISH    the worker is done; the server exits once every worker is

A parameter reply is the server's version (one int64), then each of its buckets in order,
one message each, so a server sends a bucket as soon as its update is done and a worker
receives it straight into its parameter buffer.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from dtrain import advice
from dtrain.errors import DtrainError
from dtrain.strategies.ps.roles import Roles

HEADER, PAYLOAD, REPLY, NORM, PUSH_TAGS = 0, 1, 2, 3, 16
"""Message tags; NORM carries a server's share of a sync round's squared gradient norm
to the other servers."""
FIXED_FIELDS = 5
STATS = (
    "updates",  # optimizer steps applied
    "used",  # gradients those steps used
    "dropped",  # sync: late gradients of a closed round
    "min_used",  # fewest gradients in one update
    "max_used",  # most gradients in one update
    "max_gap",  # largest step gap between a starting worker and the slowest
    "max_staleness",  # async/ssp: most updates between a gradient's version and its use
    "staleness_sum",  # async/ssp: sum of the staleness of applied gradients
    "applied",  # async/ssp: gradients applied one by one
    "pending",  # sync: gradients waiting in the open round
)


class Op(IntEnum):
    """Request kinds a worker sends a server."""

    COMMIT = 2
    PULL = 3
    GET_STATE = 4
    SET_STATE = 5
    STATS = 6
    FINISH = 7
    PAUSE = 8
    RESUME = 9


class ParameterServerError(DtrainError):
    """A worker or server of the parameter-server job stopped answering, or misbehaved."""


def header(
    op: Op,
    sender: int,
    a: float = 0,
    b: float = 0,
    c: float = 0,
    settings: list[float] | None = None,
    width: int = 0,
) -> torch.Tensor:
    """A header tensor of FIXED_FIELDS + `width` float64 values (`settings`, or zeros)."""
    values = [float(op), float(sender), float(a), float(b), float(c)]
    values += settings if settings is not None else [0.0] * width
    return torch.tensor(values, dtype=torch.float64)


@dataclass(frozen=True)
class Channel:
    """The messages of one training run, over a process group of every rank of the job
    made for that run: receives a run leaves posted when it ends (a server always has the
    next pushes' posted) can never take a later run's messages.

    A message that cannot go through raises :class:`ParameterServerError` naming the
    peer: gloo fails a send or receive at once when the peer's connection closed (it
    died), and a wait once the timeout passed (it hangs, or is only slow).
    """

    group: dist.ProcessGroup
    roles: Roles
    rank: int
    """This process's global rank."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending `tensor` (CPU, contiguous) to global rank `dst`."""
        try:
            work = dist.isend(tensor, dst, group=self.group, tag=tag)
        except RuntimeError as e:  # gloo refuses a send over a connection that has ended
            what = f"{self._me()} sending to {self.roles.name(dst)}"
            raise self._failed(e, what, dst, None) from None
        assert work is not None
        return work

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> dist.Work:
        """Start receiving into `tensor` from global rank `src` (None: any rank)."""
        try:
            work = dist.irecv(tensor, src, group=self.group, tag=tag)
        except RuntimeError as e:
            source = "any worker" if src is None else self.roles.name(src)
            raise self._failed(e, f"{self._me()} receiving from {source}", src, None) from None
        assert work is not None
        return work

    def wait(self, work: dist.Work, timeout_s: float, what: str, peer: int | None) -> None:
        """Wait for a send or receive (`what`, with global rank `peer`; None: any worker),
        turning a timeout or an ended connection into a ParameterServerError naming
        `peer`."""
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise self._failed(e, what, peer, timeout_s) from None

    def _me(self) -> str:
        name = self.roles.name(self.rank)
        return name[0].upper() + name[1:]

    def _failed(
        self, error: RuntimeError, what: str, peer: int | None, timeout_s: float | None
    ) -> ParameterServerError:
        """The error for `what`, which gloo ended with `error`: a wait past `timeout_s`
        (None: no wait of this call timed out), or a connection to `peer` that ended."""
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        # gloo's "[.../pair.cc:537] Read error [ADDRESS]:PORT: Connection reset by peer. This
        # is typically caused by ...": its reason, without the source line and the advice.
        reason = _GLOO_SOURCE.sub("", first).split(". ")[0].rstrip(".")
        who = "a worker"
        if peer is not None:
            found = _PEER_ADDRESS.search(reason)
            at = f", at {found.group(1)}" if found else ""
            who = f"{self.roles.name(peer)} (rank {peer}{at})"
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            within = f" within {timeout_s:g}s" if timeout_s is not None else ""
            return ParameterServerError(
                f"{what} did not complete{within} ({reason}): {who} hung or stopped. The "
                "launcher's report says where it stood; raise --timeout if the job is only "
                "slow."
            )
        return ParameterServerError(
            f"{what} failed: the connection ended ({reason}) because {who} stopped: it was "
            "killed, ran out of memory or failed, as the launcher's report says. The job "
            f"cannot go on without it; start it again ({advice.how_to_resume()})."
        )


_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.\w+:\d+\]\s*")
"""gloo's "[path/to/file.cc:LINE] " before its message."""
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
"""gloo's "[10.0.0.2]:41234": the peer's address and port."""


def to_bytes(obj: Any) -> torch.Tensor:
    """Serialise tensors, numbers, strings and containers of them as a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    """Inverse of :func:`to_bytes` (loaded with weights_only=True)."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
