"""A parameter server: holds a shard of the parameters and their optimizer state on the CPU.

One loop receives requests from any worker (see protocol.py) and applies the mode's rule:

- sync: a round collects the gradients computed on the current version; once W - B of
  them arrived (B backup workers) it averages them and applies one update; gradients of
  a closed round arrive late and are dropped (counted). Equal to single-device SGD on the
  global batch when B = 0.
- async: every gradient is applied when it arrives; its staleness (updates applied since
  the version it was computed on) is measured, and with the staleness-aware rate its
  learning rate is divided by it (Zhang et al., IJCAI 2016).
- ssp: updates as async, but a worker's pull is answered only once it is at most s steps
  ahead of the slowest unfinished worker (Stale Synchronous Parallel, Ho et al., NIPS 2013).

The server keeps its keys back to back in one flat buffer; the optimizer's parameters
are views of it, so an update changes the buffer that pulls send.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from dtrain.config import Config
from dtrain.observe.logs import LOGGER
from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.optimizer import rebuild
from dtrain.strategies.ps.protocol import HEADER, PAYLOAD, REPLY, Op
from dtrain.strategies.ps.sharding import ServerShard


class Server:
    """Serve one shard until every worker has finished.

    Args:
        index: this server's index in [0, K); its global rank is `workers + index`.
        shard: the keys it holds.
        flat_params: every served parameter flattened, in optimizer order (initial values).
        template: the user's optimizer, rebuilt here over the shard.
        workers: number of workers W (global ranks 0..W-1).
        config: mode, staleness, backup workers, timeout.
    """

    def __init__(
        self,
        index: int,
        shard: ServerShard,
        flat_params: list[torch.Tensor],
        template: Optimizer,
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
        self.flat = torch.empty(shard.numel, dtype=flat_params[0].dtype)
        for key in self.keys:
            piece = protocol.gather_key(flat_params[key.param], key.ranges)
            self.flat[key.offset : key.offset + key.numel].copy_(piece)
        self.params = [
            nn.Parameter(self._view(self.flat, key.offset, key.numel)) for key in self.keys
        ]
        groups: list[list[nn.Parameter]] = [[] for _ in template.param_groups]
        for key, param in zip(self.keys, self.params, strict=True):
            groups[key.group].append(param)
        self.optimizer, self.group_origin = rebuild(template, groups)
        self.user_groups = len(template.param_groups)
        self.received = [torch.zeros_like(self.flat) for _ in range(workers)]
        self.round_sum = torch.zeros_like(self.flat)
        self.round_count = 0
        self.round_first = 0
        self.round_members: set[int] = set()
        self.version = 0
        self.clocks = [0] * workers
        self.finished: set[int] = set()
        self.paused: set[int] = set()
        """Workers between steps (evaluating, saving): no gradient will come from them."""
        self.waiting: dict[int, int] = {}
        """Gated pulls not yet answered: worker -> the version it needs (sync)."""
        self.sending: list[tuple[protocol.dist.Work, torch.Tensor]] = []
        self.stats = dict.fromkeys(protocol.STATS, 0)

    @staticmethod
    def _view(flat: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
        return flat[offset : offset + numel]

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Answer requests until every worker sent FINISH."""
        head = torch.empty(protocol.FIXED_FIELDS + self.user_groups, dtype=torch.float64)
        while len(self.finished) < self.workers:
            work = protocol.recv(head, None, HEADER)
            protocol.wait(work, self.config.timeout_s, f"Server {self.index} waiting for workers")
            op, sender, a = Op(int(head[0])), int(head[1]), head[2].item()
            if op is Op.PUSH:
                bucket = self.buckets[int(a)]
                self._recv(self._view(self.received[sender], bucket.offset, bucket.numel), sender)
            elif op is Op.COMMIT:
                self._commit(sender, int(a), head[protocol.FIXED_FIELDS :].tolist())
                self.waiting[sender] = int(a) + 1
            elif op is Op.PULL:
                self._reply_params(sender, gated=False)
            elif op is Op.GET_STATE:
                self._send_bytes(sender, self._state())
            elif op is Op.SET_STATE:
                data = torch.empty(int(a), dtype=torch.uint8)
                self._recv(data, sender)
                self._set_state(protocol.from_bytes(data))
                self._send(torch.ones(1), sender)
            elif op is Op.STATS:
                self.stats["pending"] = self.round_count
                counters = [float(self.stats[name]) for name in protocol.STATS]
                self._send(torch.tensor(counters, dtype=torch.float64), sender)
            elif op is Op.RESUME:
                self.paused.discard(sender)
            elif op in (Op.FINISH, Op.PAUSE):
                (self.finished if op is Op.FINISH else self.paused).add(sender)
                self._maybe_close_round()
            self._answer_pulls()
        self._finish_sends()
        LOGGER.info("server %d done: %s", self.index, self.stats)

    # -- updates ---------------------------------------------------------------------------
    def _commit(self, worker: int, version: int, lrs: list[float]) -> None:
        for group, origin in zip(self.optimizer.param_groups, self.group_origin, strict=True):
            group["lr"] = lrs[origin]
        self.clocks[worker] += 1
        if self.mode == "sync":
            if version < self.version:
                self.stats["dropped"] += 1
                return
            # The first gradient stays in its receive buffer (its worker waits for this
            # round's update before pushing again); the sum is made from the second on.
            self.round_members.add(worker)
            if self.round_count == 0:
                self.round_first = worker
            elif self.round_count == 1:
                torch.add(
                    self.received[self.round_first], self.received[worker], out=self.round_sum
                )
            else:
                self.round_sum += self.received[worker]
            self.round_count += 1
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
        self._apply(self.received[worker], scale, used=1)

    def _maybe_close_round(self) -> None:
        """Sync: apply the round's mean once W - B gradients are in."""
        if self.mode != "sync" or self.round_count == 0:
            return
        if self._round_impossible():
            # Too few workers are stepping to fill the round: its gradients are dropped
            # (an update always uses exactly W - B) and waiting pulls get the current version.
            self.stats["dropped"] += self.round_count
            self.round_count = 0
            self.round_members.clear()
            return
        if self.round_count < self.workers - self.config.backup_workers:
            return
        if self.round_count == 1:
            mean = self.received[self.round_first]
        else:
            mean = self.round_sum.div_(self.round_count)
        self._apply(mean, 1.0, used=self.round_count)
        self.round_count = 0
        self.round_members.clear()

    def _round_impossible(self) -> bool:
        """Sync: the open round cannot reach W - B gradients any more: its members plus
        the workers still stepping (not finished or paused) that are not in it are too few."""
        idle = self.finished | self.paused | self.round_members
        stepping = self.workers - len(idle)
        return len(self.round_members) + stepping < self.workers - self.config.backup_workers

    def _apply(self, gradient: torch.Tensor, scale: float, used: int) -> None:
        self._finish_sends()  # replies read `flat` in place; the update may not race them
        for key, param in zip(self.keys, self.params, strict=True):
            param.grad = self._view(gradient, key.offset, key.numel)
        if scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= scale
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        self.version += 1
        stats = self.stats
        stats["min_used"] = used if stats["updates"] == 0 else min(stats["min_used"], used)
        stats["max_used"] = max(stats["max_used"], used)
        stats["updates"] += 1
        stats["used"] += used

    # -- pulls -----------------------------------------------------------------------------
    def _ready(self, worker: int, needed_version: int) -> bool:
        if self.mode == "sync":
            return self.version >= needed_version or self._round_impossible()
        if self.mode == "async":
            return True
        active = [c for w, c in enumerate(self.clocks) if w not in self.finished]
        slowest = min(active) if active else self.clocks[worker]
        return self.clocks[worker] - slowest <= self.staleness_bound

    def _answer_pulls(self) -> None:
        for worker, needed in list(self.waiting.items()):
            if self._ready(worker, needed):
                del self.waiting[worker]
                self._reply_params(worker, gated=True)

    def _reply_params(self, worker: int, gated: bool) -> None:
        if gated:
            # The worker starts step clocks[worker] (0-based) while the slowest unfinished
            # one works on step min(clocks): their distance is the step gap.
            active = [c for w, c in enumerate(self.clocks) if w not in self.finished]
            gap = self.clocks[worker] - min(active, default=self.clocks[worker])
            self.stats["max_gap"] = max(self.stats["max_gap"], gap)
        self._send(torch.tensor([self.version], dtype=torch.int64), worker)
        self._send(self.flat, worker)

    # -- checkpoints -------------------------------------------------------------------------
    def _state(self) -> dict[int, dict[str, object]]:
        """Optimizer state of each key, by key index (tensors 1-D over the key)."""
        return {
            i: dict(self.optimizer.state[param])
            for i, param in enumerate(self.params)
            if param in self.optimizer.state
        }

    @torch.no_grad()
    def _set_state(self, data: dict[str, object]) -> None:
        self._finish_sends()
        self.flat.copy_(data["params"])  # type: ignore[arg-type]
        states: dict[int, dict[str, object]] = data["state"]  # type: ignore[assignment]
        for i, param in enumerate(self.params):
            if i in states:
                self.optimizer.state[param] = dict(states[i])
            else:
                self.optimizer.state.pop(param, None)

    # -- transport -------------------------------------------------------------------------
    def _recv(self, tensor: torch.Tensor, worker: int) -> None:
        what = f"Server {self.index} receiving from worker {worker}"
        protocol.wait(protocol.recv(tensor, worker, PAYLOAD), self.config.timeout_s, what)

    def _finish_sends(self) -> None:
        for work, _ in self.sending:
            protocol.wait(work, self.config.timeout_s, f"Server {self.index} sending a reply")
        self.sending = []

    def _send(self, tensor: torch.Tensor, worker: int) -> None:
        self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]
        self.sending.append((protocol.send(tensor, worker, REPLY), tensor))

    def _send_bytes(self, worker: int, obj: object) -> None:
        data = protocol.to_bytes(obj)
        self._send(torch.tensor([data.numel()], dtype=torch.int64), worker)
        self._send(data, worker)
