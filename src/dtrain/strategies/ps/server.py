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

The server keeps its buckets back to back in one flat buffer; the optimizer's parameters
(one per key) are views of it, so an update changes the buffer that replies send. An
update runs bucket by bucket, each bucket with an optimizer of its own, and each bucket
goes out to the workers whose pull the update releases as soon as it is updated, while
the next bucket is updated (as BytePS pipelines its summation and replies).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dtrain.config import Config
from dtrain.observe.logs import LOGGER
from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.handshake import Description
from dtrain.strategies.ps.optimizer import BY_NAME
from dtrain.strategies.ps.protocol import HEADER, PAYLOAD, REPLY, Op
from dtrain.strategies.ps.sharding import ServerShard
from dtrain.strategies.rebuild import restate

Sends = list[tuple[protocol.dist.Work, torch.Tensor]]


class Server:
    """Serve one shard until every worker has finished.

    Args:
        index: this server's index in [0, K); its global rank is `workers + index`.
        shard: the buckets and keys it holds.
        values: every served parameter, flat in the workers' layout (initial values).
        description: the optimizer to rebuild over the shard (worker 0's).
        workers: number of workers W (global ranks 0..W-1).
        config: mode, staleness, backup workers, timeout.
    """

    def __init__(
        self,
        index: int,
        shard: ServerShard,
        values: torch.Tensor,
        description: Description,
        workers: int,
        config: Config,
    ) -> None:
        self.index = index
        self.keys = shard.keys
        self.buckets = shard.buckets
        self.workers = workers
        self.config = config
        self.mode = config.ps_mode
        self.staleness_bound = 2 if config.staleness is None else config.staleness
        self.flat = torch.empty(shard.numel, dtype=values.dtype)
        for bucket in self.buckets:
            self.flat[bucket.offset : bucket.offset + bucket.numel].copy_(
                values[bucket.start : bucket.start + bucket.numel]
            )
        self.params = [
            nn.Parameter(self.flat[key.offset : key.offset + key.numel]) for key in self.keys
        ]
        groups = len(description.settings)
        optimizer_class = BY_NAME[description.optimizer]
        self.optimizers = [
            restate(
                optimizer_class,
                description.settings,
                [
                    [self.params[k] for k in bucket.keys if self.keys[k].group == g]
                    for g in range(groups)
                ],
                description.defaults,
            )
            for bucket in self.buckets
        ]
        self.bucket_of_key = [b for b, bucket in enumerate(self.buckets) for _ in bucket.keys]
        self.groups = groups
        self.received = [torch.zeros_like(self.flat) for _ in range(workers)]
        self.round_sum = torch.zeros_like(self.flat)
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
        self.bucket_sends: list[Sends] = [[] for _ in self.buckets]
        """Replies reading each bucket of `flat`: an update of the bucket waits for them."""
        self.other_sends: Sends = []
        self.versions_out = [torch.zeros(1, dtype=torch.int64) for _ in range(workers)]
        self.version_sends: list[Sends] = [[] for _ in range(workers)]
        """The reply of each worker's version tensor (at most one in flight)."""
        self.stats = dict.fromkeys(protocol.STATS, 0)

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer requests until every worker sent FINISH."""
        head = torch.empty(protocol.FIXED_FIELDS + self.groups, dtype=torch.float64)
        while len(self.finished) < self.workers:
            work = protocol.recv(head, None, HEADER)
            protocol.wait(work, self.config.timeout_s, f"Server {self.index} waiting for workers")
            op, sender, a = Op(int(head[0])), int(head[1]), head[2].item()
            if op is Op.PUSH:
                bucket = self.buckets[int(a)]
                target = self.received[sender][bucket.offset : bucket.offset + bucket.numel]
                self._recv(target, sender)
            elif op is Op.COMMIT:
                self.waiting[sender] = int(a) + 1
                self._commit(sender, int(a), head[protocol.FIXED_FIELDS :].tolist())
            elif op is Op.PULL:
                self._reply_params(sender)
            elif op is Op.GET_STATE:
                self._send_bytes(sender, self._state())
            elif op is Op.SET_STATE:
                data = torch.empty(int(a), dtype=torch.uint8)
                self._recv(data, sender)
                self._set_state(protocol.from_bytes(data))
                self._send_other(torch.ones(1), sender)
            elif op is Op.STATS:
                self.stats["pending"] = len(self.members)
                counters = [float(self.stats[name]) for name in protocol.STATS]
                self._send_other(torch.tensor(counters, dtype=torch.float64), sender)
            elif op is Op.RESUME:
                self.paused.discard(sender)
            elif op in (Op.FINISH, Op.PAUSE):
                (self.finished if op is Op.FINISH else self.paused).add(sender)
                self._maybe_close_round()
            for worker in self._take_ready():
                self._reply_params(worker)
        self._finish_sends()
        LOGGER.info("server %d done: %s", self.index, self.stats)

    # -- updates ---------------------------------------------------------------------------
    def _commit(self, worker: int, version: int, lrs: list[float]) -> None:
        self.clocks[worker] += 1
        if self.mode == "sync":
            if version < self.version:
                self.stats["dropped"] += 1
                return
            self._set_lrs(lrs, 1.0)
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
        self._set_lrs(lrs, scale)
        received = self.received[worker]
        self._apply(lambda b: self._slice(received, b), used=1)

    def _set_lrs(self, lrs: list[float], scale: float) -> None:
        for optimizer in self.optimizers:
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr * scale

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
        count = len(self.members)
        if count == 1:
            first = self.received[self.members[0]]
            self._apply(lambda b: self._slice(first, b), used=1)
        else:
            # The last gradient is added bucket by bucket, inside the pipelined update.
            self._apply(lambda b: self._round_mean(b, count), used=count)
        self.members.clear()
        self.folded = 0

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

    def _apply(self, gradient: Callable[[int], torch.Tensor], used: int) -> None:
        """One update with the gradient `gradient(b)` of each bucket b, bucket by bucket;
        each updated bucket goes at once to the workers whose pull the update releases."""
        self.version += 1
        stats = self.stats
        stats["min_used"] = used if stats["updates"] == 0 else min(stats["min_used"], used)
        stats["max_used"] = max(stats["max_used"], used)
        stats["updates"] += 1
        stats["used"] += used
        recipients = self._take_ready()
        for worker in recipients:
            self._send_version(worker)
        for b, bucket in enumerate(self.buckets):
            self._wait(self.bucket_sends[b])  # replies read the bucket in place
            grad = gradient(b)
            for k in bucket.keys:
                key = self.keys[k]
                at = key.offset - bucket.offset
                self.params[k].grad = grad[at : at + key.numel]
            self.optimizers[b].step()
            for k in bucket.keys:
                self.params[k].grad = None
            for worker in recipients:
                self._send_bucket(b, worker)

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
        """The workers whose gated pull can be answered now (no longer waiting)."""
        ready = [w for w, needed in self.waiting.items() if self._ready(w, needed)]
        active = [c for w, c in enumerate(self.clocks) if w not in self.finished]
        for worker in ready:
            del self.waiting[worker]
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
    def _state(self) -> dict[int, dict[str, object]]:
        """Optimizer state of each key, by key index (tensors 1-D over the key)."""
        result = {}
        for i, param in enumerate(self.params):
            state = self.optimizers[self.bucket_of_key[i]].state
            if param in state:
                result[i] = dict(state[param])
        return result

    @torch.no_grad()
    def _set_state(self, data: dict[str, object]) -> None:
        self._finish_sends()
        self.flat.copy_(data["params"])  # type: ignore[arg-type]
        states: dict[int, dict[str, object]] | None = data["state"]  # type: ignore[assignment]
        if states is None:  # the parameters alone were loaded: keep the optimizer state
            return
        for i, param in enumerate(self.params):
            state = self.optimizers[self.bucket_of_key[i]].state
            if i in states:
                state[param] = dict(states[i])
            else:
                state.pop(param, None)

    # -- transport -------------------------------------------------------------------------
    def _recv(self, tensor: torch.Tensor, worker: int) -> None:
        what = f"Server {self.index} receiving from worker {worker}"
        protocol.wait(protocol.recv(tensor, worker, PAYLOAD), self.config.timeout_s, what)

    def _wait(self, sends: Sends) -> None:
        for work, _ in sends:
            protocol.wait(work, self.config.timeout_s, f"Server {self.index} sending a reply")
        sends.clear()

    def _finish_sends(self) -> None:
        for sends in [*self.bucket_sends, *self.version_sends, self.other_sends]:
            self._wait(sends)

    def _send_version(self, worker: int) -> None:
        # One version tensor per worker, reused: its previous reply has gone by now (the
        # worker received it before asking again), so this wait returns at once.
        self._wait(self.version_sends[worker])
        tensor = self.versions_out[worker].fill_(self.version)
        self.version_sends[worker].append((protocol.send(tensor, worker, REPLY), tensor))

    def _send_bucket(self, b: int, worker: int) -> None:
        view = self._slice(self.flat, b)
        self.bucket_sends[b].append((protocol.send(view, worker, REPLY), view))

    def _send_other(self, tensor: torch.Tensor, worker: int) -> None:
        self.other_sends = [(w, t) for w, t in self.other_sends if not w.is_completed()]
        self.other_sends.append((protocol.send(tensor, worker, REPLY), tensor))

    def _send_bytes(self, worker: int, obj: object) -> None:
        data = protocol.to_bytes(obj)
        self._send_other(torch.tensor([data.numel()], dtype=torch.int64), worker)
        self._send_other(data, worker)
