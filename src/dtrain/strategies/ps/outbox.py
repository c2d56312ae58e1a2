"""A server's replies, sent in order by a thread of their own.

A gloo send to a worker that has posted its receive writes the message in the calling
thread, so a loop that updated a bucket and then sent it would update the next bucket
only once the last one had gone. Handing the sends to this thread lets the server's loop
update bucket b + 1 while bucket b is being sent (the pipeline of BytePS's servers), and
go back to receiving requests while the last buckets of a reply are still on their way.
Every reply goes through the one queue, so a worker receives them in the order the loop
queued them (gloo keeps one sender's order on one tag).
"""

from __future__ import annotations

import collections
import queue
import threading

import torch
import torch.distributed as dist

from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.protocol import REPLY


class Outbox:
    """Send queued tensors to workers, one after the other, from a thread.

    Args:
        channel: the run's messages.
        index: the server's index (named in errors).
        timeout_s: how long a send, or a wait for one, may last.
    """

    def __init__(self, channel: protocol.Channel, index: int, timeout_s: float) -> None:
        self.channel = channel
        self.index = index
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[int, torch.Tensor, int] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self.queued = 0
        """The ticket of the last queued send."""
        self._sent = 0
        self._error: BaseException | None = None
        # A daemon: a server whose loop failed must not be kept alive by a reply.
        self._thread = threading.Thread(
            target=self._run, name=f"ps-server-{index}-replies", daemon=True
        )
        self._thread.start()

    def send(self, tensor: torch.Tensor, rank: int) -> int:
        """Queue `tensor` (left unchanged until sent) for global `rank`; return its ticket."""
        self._raise()
        self.queued += 1
        self._queue.put((self.queued, tensor, rank))
        return self.queued

    def wait(self, ticket: int) -> None:
        """Return once every send up to `ticket` has completed."""
        with self._done:
            settled = self._done.wait_for(
                lambda: self._sent >= ticket or self._error is not None, self.timeout_s
            )
            if not settled:
                self._error = protocol.ParameterServerError(
                    f"Server {self.index} could not send its replies within "
                    f"{self.timeout_s:g}s. A worker has probably died; its own error, "
                    "reported by the launcher, says why. Raise --timeout if the job is only "
                    "slow."
                )
        self._raise()

    def close(self) -> None:
        """Return once everything queued has been sent, with the thread stopped."""
        self.wait(self.queued)
        self._queue.put(None)
        self._thread.join()

    def abandon(self) -> None:
        """Let the thread stop after what it is sending (the serving loop has failed; the
        thread is a daemon, so it cannot keep the process alive)."""
        self._queue.put(None)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        # Sends are started as soon as they are queued (gloo sends one peer's messages in
        # the order they were started) and waited for, oldest first, while nothing new is
        # queued.
        inflight: collections.deque[tuple[int, dist.Work, torch.Tensor, int]]
        inflight = collections.deque()
        try:
            while True:
                if inflight and self._queue.empty():
                    ticket, work, _, rank = inflight.popleft()
                    what = f"Server {self.index} sending a reply to {self.channel.roles.name(rank)}"
                    self.channel.wait(work, self.timeout_s, what, rank)
                    with self._done:
                        self._sent = ticket
                        self._done.notify_all()
                    continue
                item = self._queue.get()
                if item is None:
                    if not inflight:
                        return
                    self._queue.put(None)  # stop once the sends in flight are done
                    continue
                ticket, tensor, rank = item
                inflight.append((ticket, self.channel.send(tensor, rank, REPLY), tensor, rank))
        except BaseException as e:  # noqa: BLE001 - handed to the serving loop
            with self._done:
                self._error = e
                self._done.notify_all()
