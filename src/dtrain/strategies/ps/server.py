"""A parameter server: holds a shard of the parameters and their optimizer state on the CPU.

One loop receives requests from any worker (see protocol.py) and applies the mode's rule:

- sync: a round collects the gradients computed on the current version; once W - B of
  them arrived (B backup workers) it averages them and applies one update; gradients of
  a closed round arrive late and are dropped (counted). Equal to single-device training
  on the global batch when B = 0.
- async: every gradient is applied when it arrives; its staleness (updates applied since
  the version it was computed on) is measured, and with the staleness-aware rate its
  learning rate is divided by it (Zhang et al., IJCAI 2016).
- ssp: updates as async, but a worker's pull is answered only once it is at most s steps
  ahead of the slowest unfinished worker (Stale Synchronous Parallel, Ho et al., NIPS 2013).

A parameter no gradient of an update has is not stepped, as a torch optimizer skips a
parameter whose `.grad` is None (no weight decay, no momentum, no step count). In sync
mode that is a parameter none of the round's workers has a gradient for; if some have
one, the others' count as zeros, since `single` over the global batch would have a
gradient, the sum over every sample's (a worker whose samples did not reach the
parameter adds nothing to it).

The server keeps its buckets back to back in one flat buffer; the optimizer's parameters
(one per key, shard_optimizer.py) are views of it, so an update changes the buffer that
replies send. An update runs bucket by bucket, and each bucket goes out to the workers
whose pull the update releases as soon as it is updated, from the outbox's thread, while
the next bucket is updated (as BytePS pipelines its summation and replies).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dtrain.config import Config
from dtrain.process.logs import LOGGER
from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.handshake import Start
from dtrain.strategies.ps.optimizer import GroupSettings
from dtrain.strategies.ps.outbox import Outbox
from dtrain.strategies.ps.protocol import HEADER, NORM, PAYLOAD, PUSH_TAGS, Op
from dtrain.strategies.ps.roles import Roles
from dtrain.strategies.ps.shard_optimizer import ShardOptimizer
from dtrain.strategies.ps.sharding import ServerShard


class Server:
    """Serve one shard until every worker has finished.

    Args:
        index: this server's index in [0, K) (roles.py gives its global rank).
        shard: the buckets and keys it holds.
        start: the handshake's result: the optimizer to rebuild over the shard (worker
            0's description), the initial values, the run's channel.
        config: the layout (--nproc, --servers, --nnodes), mode, staleness, backup
            workers, timeout.
    """

    def __init__(self, index: int, shard: ServerShard, start: Start, config: Config) -> None:
        description, values = start.description, start.values
        self.index = index
        self.buckets = shard.buckets
        self.roles = Roles.of(config)
        self.workers = workers = self.roles.workers
        self.worker_ranks = self.roles.worker_ranks
        self.channel = start.channel
        self.config = config
        self.mode = config.ps_mode
        self.staleness_bound = 2 if config.staleness is None else config.staleness
        self.flat = torch.empty(shard.numel, dtype=values.dtype)
        for bucket in self.buckets:
            self.flat[bucket.offset : bucket.offset + bucket.numel].copy_(
                values[bucket.start : bucket.start + bucket.numel]
            )
        self.optimizer = ShardOptimizer(shard, self.flat, description)
        self.settings = GroupSettings(description.settings)
        self.key_params = [key.param for key in shard.keys]
        self.params = len(description.sizes)
        self.received = [torch.zeros_like(self.flat) for _ in range(workers)]
        self.present: list[list[bool] | None] = [None] * workers
        """Which of this server's keys each worker's last gradient has (None: all)."""
        self.pushes: dict[int, list[protocol.dist.Work]] = {}
        """The posted receives of each worker's next buckets (see _post_pushes)."""
        self.round_sum = torch.zeros_like(self.flat)
        self.round_clip = 0.0
        """Sync: the bound on the open round's mean gradient norm (0: no clipping)."""
        self.members: list[int] = []
        """Sync: the workers whose gradient is in the open round, in arrival order."""
        self.folded = 0
        """Sync: how many of `members` round_sum holds (0: none, else at least 2)."""
        self.version = 0
        self.clocks = [0] * workers
        self.finished: set[int] = set()
        self.paused: set[int] = set()
        """Workers between steps (evaluating, saving): no gradient will come from them."""
        self.waiting: dict[int, int] = {}
        """Gated pulls not yet answered: worker -> the version it needs (sync)."""
        self.outbox = Outbox(self.channel, index, config.timeout_s)
        self.bucket_sent = [0] * len(self.buckets)
        """The outbox ticket of the last reply reading each bucket of `flat` in place: an
        update of the bucket waits for it."""
        self.versions_out = [torch.zeros(1, dtype=torch.int64) for _ in range(workers)]
        self.version_sent = [0] * workers
        """The ticket of each worker's version tensor, reused once it has gone."""
        self.stats = dict.fromkeys(protocol.STATS, 0)

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer requests until every worker sent FINISH."""
        try:
            self._loop()
        except BaseException:
            self.outbox.abandon()
            raise
        self.outbox.close()
        LOGGER.info("server %d done: %s", self.index, self.stats)

    def _loop(self) -> None:
        head = torch.empty(protocol.FIXED_FIELDS + self.settings.width, dtype=torch.float64)
        for worker in range(self.workers):
            self._post_pushes(worker)
        while len(self.finished) < self.workers:
            work = self.channel.recv(head, None, HEADER)
            what = f"Server {self.index} waiting for workers"
            self.channel.wait(work, self.config.timeout_s, what, None)
            op, sender, a = Op(int(head[0])), int(head[1]), head[2].item()
            if op is Op.COMMIT:
                what = f"Server {self.index} receiving gradients from worker {sender}"
                for work in self.pushes.pop(sender):
                    self.channel.wait(work, self.config.timeout_s, what, self.worker_ranks[sender])
                masked = head[4].item()  # a mask of the parameters with a gradient follows
                self.present[sender] = self._recv_present(sender) if masked else None
                self.waiting[sender] = int(a) + 1
                clip = head[3].item()
                settings = self.settings.decode(head[protocol.FIXED_FIELDS :].tolist())
                self._commit(sender, int(a), settings, clip)
            elif op is Op.PULL:
                self._reply_params(sender)
            elif op is Op.GET_STATE:
                self._send_bytes(sender, self.optimizer.state())
            elif op is Op.SET_STATE:
                data = torch.empty(int(a), dtype=torch.uint8)
                self._recv(data, sender)
                self._set_state(protocol.from_bytes(data))
                self._reply(torch.ones(1), sender)
            elif op is Op.STATS:
                self.stats["pending"] = len(self.members)
                counters = [float(self.stats[name]) for name in protocol.STATS]
                self._reply(torch.tensor(counters, dtype=torch.float64), sender)
            elif op is Op.RESUME:
                self.paused.discard(sender)
            elif op in (Op.FINISH, Op.PAUSE):
                (self.finished if op is Op.FINISH else self.paused).add(sender)
                self._maybe_close_round()
            for worker in self._take_ready():
                self._reply_params(worker)

    # -- updates ---------------------------------------------------------------------------
    def _commit(
        self, worker: int, version: int, settings: list[dict[str, Any]], clip: float
    ) -> None:
        self.clocks[worker] += 1
        if self.mode == "sync":
            if version < self.version:
                self.stats["dropped"] += 1
                return
            self.optimizer.set_settings(settings, 1.0)
            self.round_clip = clip
            self.members.append(worker)
            self._maybe_close_round()
            return
        staleness = self.version - version
        self.stats["max_staleness"] = max(self.stats["max_staleness"], staleness)
        self.stats["staleness_sum"] += staleness
        self.stats["applied"] += 1
        # A worker's gradient is the mean over its 1/W share of the global batch; applied
        # alone it gets lr/W, so every sample weighs in as in the global-batch mean (and W
        # pushes in a row move as far as one sync round).
        scale = 1.0 / self.workers
        if self.config.staleness_lr:
            scale /= max(1, staleness)
        self.optimizer.set_settings(settings, scale)
        received = self.received[worker]
        if clip > 0:  # the worker measured its gradient's norm and sent the factor
            received.mul_(clip)
        self._apply(lambda b: self._slice(received, b), [worker])

    def _maybe_close_round(self) -> None:
        """Sync: apply the round's mean once W - B gradients are in."""
        if self.mode != "sync" or not self.members:
            return
        if self._round_impossible():
            # Too few workers are stepping to fill the round: its gradients are dropped
            # (an update always uses exactly W - B) and waiting pulls get the current version.
            self.stats["dropped"] += len(self.members)
            self.members.clear()
            self.folded = 0
            return
        if len(self.members) < self.workers - self.config.backup_workers:
            # Sum what is in while the others compute; the first gradient stays in its
            # receive buffer (its worker waits for this round's update before pushing
            # again) and the sum starts with the second.
            if len(self.members) >= 2:
                self._fold(0, self.flat.numel())
                self.folded = len(self.members)
            return
        count, members = len(self.members), self.members  # _apply reads them before clear()
        if self.round_clip > 0:
            # The whole mean first: its global norm decides the factor of every bucket.
            if count == 1:
                mean = self.received[self.members[0]]
            else:
                mean = self._fold(0, self.flat.numel()).div_(count)
            mean.mul_(self._clip_factor(mean, self.round_clip))
            self._apply(lambda b: self._slice(mean, b), members)
        elif count == 1:
            first = self.received[self.members[0]]
            self._apply(lambda b: self._slice(first, b), members)
        else:
            # The last gradient is added bucket by bucket, inside the pipelined update.
            self._apply(lambda b: self._round_mean(b, count), members)
        self.members.clear()
        self.folded = 0

    def _clip_factor(self, mean: torch.Tensor, bound: float) -> float:
        """min(1, bound / global norm of the round's mean gradient): this server's share of
        the squared norm goes to every other server and theirs come back (each server
        closes the same rounds in the same order, so the r-th shares belong together)."""
        # |z|^2 for a complex gradient, as torch's clip_grad_norm_ counts it in `single`.
        wide = torch.promote_types(mean.dtype, torch.float64)
        share = torch.linalg.vector_norm(mean, dtype=wide).square().reshape(1)
        ranks = self.roles.server_ranks
        others = [j for j in range(len(ranks)) if j != self.index]
        sends = [self.channel.send(share, ranks[j], NORM) for j in others]
        total, timeout_s = share.item(), self.config.timeout_s
        for j in others:
            got = torch.empty(1, dtype=torch.float64)
            what = f"Server {self.index} waiting for server {j}'s gradient norm"
            self.channel.wait(self.channel.recv(got, ranks[j], NORM), timeout_s, what, ranks[j])
            total += got.item()
        for j, work in zip(others, sends, strict=True):
            what = f"Server {self.index} sending its gradient norm to server {j}"
            self.channel.wait(work, timeout_s, what, ranks[j])
        return min(1.0, bound / (math.sqrt(total) + 1e-6))

    def _fold(self, start: int, end: int) -> torch.Tensor:
        """round_sum[start:end] with every member's gradient added (at least two members)."""
        out = self.round_sum[start:end]
        members = self.members
        first = self.folded
        if first < 2:
            a, b = self.received[members[0]], self.received[members[1]]
            torch.add(a[start:end], b[start:end], out=out)
            first = 2
        for worker in members[first:]:
            out += self.received[worker][start:end]
        return out

    def _round_mean(self, b: int, count: int) -> torch.Tensor:
        bucket = self.buckets[b]
        return self._fold(bucket.offset, bucket.offset + bucket.numel).div_(count)

    def _round_impossible(self) -> bool:
        """Sync: the open round cannot reach W - B gradients any more: its members plus
        the workers still stepping (not finished or paused) that are not in it are too few."""
        idle = self.finished | self.paused | set(self.members)
        stepping = self.workers - len(idle)
        return len(self.members) + stepping < self.workers - self.config.backup_workers

    def _slice(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        bucket = self.buckets[b]
        return flat[bucket.offset : bucket.offset + bucket.numel]

    def _apply(self, gradient: Callable[[int], torch.Tensor], used: list[int]) -> None:
        """One update with the gradient `gradient(b)` of each bucket b, the mean of the
        gradients of the workers `used`, bucket by bucket; each updated bucket goes at once
        to the workers whose pull the update releases. A key none of them has a gradient
        for is not stepped."""
        present = self._present(used)
        self.version += 1
        stats = self.stats
        count = len(used)
        stats["min_used"] = count if stats["updates"] == 0 else min(stats["min_used"], count)
        stats["max_used"] = max(stats["max_used"], count)
        stats["updates"] += 1
        stats["used"] += count
        recipients = self._take_ready()
        for worker in recipients:
            self._send_version(worker)
        for b in range(len(self.buckets)):
            self.outbox.wait(self.bucket_sent[b])  # replies read the bucket in place
            self.optimizer.step(b, gradient(b), present)
            for worker in recipients:
                self._send_bucket(b, worker)

    def _present(self, workers: list[int]) -> list[bool] | None:
        """The keys some of `workers`' gradients have (None: all)."""
        masks = [mask for w in workers if (mask := self.present[w]) is not None]
        if len(masks) < len(workers):
            return None
        return [any(bits) for bits in zip(*masks, strict=True)]

    # -- pulls -----------------------------------------------------------------------------
    def _ready(self, worker: int, needed_version: int) -> bool:
        if self.mode == "sync":
            return self.version >= needed_version or self._round_impossible()
        if self.mode == "async":
            return True
        active = [c for w, c in enumerate(self.clocks) if w not in self.finished]
        slowest = min(active) if active else self.clocks[worker]
        return self.clocks[worker] - slowest <= self.staleness_bound

    def _take_ready(self) -> list[int]:
        """The workers whose gated pull can be answered now (no longer waiting); the
        receives of their next pushes are posted."""
        ready = [w for w, needed in self.waiting.items() if self._ready(w, needed)]
        active = [c for w, c in enumerate(self.clocks) if w not in self.finished]
        for worker in ready:
            del self.waiting[worker]
            self._post_pushes(worker)
            # The worker starts step clocks[worker] (0-based) while the slowest unfinished
            # one works on step min(clocks): their distance is the step gap.
            gap = self.clocks[worker] - min(active, default=self.clocks[worker])
            self.stats["max_gap"] = max(self.stats["max_gap"], gap)
        return ready

    def _reply_params(self, worker: int) -> None:
        self._send_version(worker)
        for b in range(len(self.buckets)):
            self._send_bucket(b, worker)

    # -- checkpoints -------------------------------------------------------------------------
    @torch.no_grad()
    def _set_state(self, data: dict[str, object]) -> None:
        self.outbox.wait(self.outbox.queued)  # replies read `flat` in place
        self.flat.copy_(data["params"])  # type: ignore[arg-type]
        if data["state"] is not None:  # None: the parameters alone were loaded
            self.optimizer.load_state(data["state"])  # type: ignore[arg-type]

    # -- transport -------------------------------------------------------------------------
    def _post_pushes(self, worker: int) -> None:
        """Post the receives of `worker`'s next buckets into its receive buffer.

        Done when its pull is answered: the worker pushes again only once it has every
        bucket of that reply, and each goes out after its update has read the buffer. So
        the pushes land in posted receives, and gloo writes them straight into place.
        """
        received = self.received[worker]
        self.pushes[worker] = [
            self.channel.recv(self._slice(received, b), self.worker_ranks[worker], PUSH_TAGS + b)
            for b in range(len(self.buckets))
        ]

    def _recv_present(self, worker: int) -> list[bool]:
        """Receive a COMMIT's mask over the parameters; which of this server's keys it has."""
        mask = torch.empty(self.params, dtype=torch.uint8)
        self._recv(mask, worker)
        has = mask.tolist()
        return [bool(has[param]) for param in self.key_params]

    def _recv(self, tensor: torch.Tensor, worker: int) -> None:
        what = f"Server {self.index} receiving from worker {worker}"
        rank = self.worker_ranks[worker]
        work = self.channel.recv(tensor, rank, PAYLOAD)
        self.channel.wait(work, self.config.timeout_s, what, rank)

    def _send_version(self, worker: int) -> None:
        # One version tensor per worker, reused: its previous reply has gone by now (the
        # worker received it before asking again), so this wait returns at once.
        self.outbox.wait(self.version_sent[worker])
        tensor = self.versions_out[worker].fill_(self.version)
        self.version_sent[worker] = self._reply(tensor, worker)

    def _send_bucket(self, b: int, worker: int) -> None:
        self.bucket_sent[b] = self._reply(self._slice(self.flat, b), worker)

    def _send_bytes(self, worker: int, obj: object) -> None:
        data = protocol.to_bytes(obj)
        self._reply(torch.tensor([data.numel()], dtype=torch.int64), worker)
        self._reply(data, worker)

    def _reply(self, tensor: torch.Tensor, worker: int) -> int:
        """Queue `tensor` for worker `worker` (an index); return the outbox's ticket."""
        return self.outbox.send(tensor, self.worker_ranks[worker])
