"""The worker's side of the parameter server: push gradients, commit, pull parameters.

Overlap, as in BytePS and PyTorch DDP: a hook on every parameter stages its gradient as
soon as backward has accumulated it, and a bucket (~4 MiB of consecutive keys of one
server) is pushed the moment its last gradient is in, while backward goes on with the
layers below. `commit` (the optimizer's `step`) then tells every server that this step's
gradients are complete, with the learning rates to use, and posts the pull of the new
parameters without waiting; the model's forward waits for it, so the pull
overlaps with loading the next batch.
(In async mode a forward that did not wait at all, computing on the parameters it had,
added about one step of staleness and made the demo diverge at momentum 0.9, so every
mode waits for its pull.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.protocol import HEADER, PAYLOAD, REPLY, Op
from dtrain.strategies.ps.sharding import Key, Plan


class Client:
    """One worker's connection to the K servers.

    Args:
        plan: where every key lives.
        params: the served parameters, in optimizer order.
        rank: this worker's global rank (in [0, W)).
        workers: W; server s has global rank W + s.
        groups: number of optimizer param groups (lr values per commit).
        timeout_s: how long any wait may last before the peer is declared dead.
    """

    def __init__(
        self,
        plan: Plan,
        params: list[nn.Parameter],
        rank: int,
        workers: int,
        groups: int,
        timeout_s: float,
    ) -> None:
        self.plan = plan
        self.params = params
        self.rank = rank
        self.servers = [workers + s for s in range(len(plan.shards))]
        self.groups = groups
        self.timeout_s = timeout_s
        # Where each parameter's keys go: (server, bucket, key); how many keys each bucket
        # still waits for this step; the staging buffer each server's pushes are cut from.
        self.by_param: list[list[tuple[int, int, Key]]] = [[] for _ in params]
        for s, shard in enumerate(plan.shards):
            for b, bucket in enumerate(shard.buckets):
                for key in shard.keys[bucket.first : bucket.last]:
                    self.by_param[key.param].append((s, b, key))
        self.bucket_sizes = [[b.last - b.first for b in shard.buckets] for shard in plan.shards]
        self.missing = [list(sizes) for sizes in self.bucket_sizes]
        self.staging = [torch.empty(shard.numel, dtype=params[0].dtype) for shard in plan.shards]
        self.versions = [0] * len(self.servers)
        self.pull_buffers = [
            (torch.empty(1, dtype=torch.int64), torch.empty(shard.numel, dtype=params[0].dtype))
            for shard in plan.shards
        ]
        self.syncing = True
        self.pushed: set[int] = set()
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.pulls: list[tuple[int, Any, torch.Tensor, Any, torch.Tensor]] = []
        self.finished = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    # -- push ------------------------------------------------------------------------------
    def _on_gradient(self, param: torch.Tensor) -> None:
        if self.syncing:
            self.push(self._index[id(param)])

    def push(self, index: int) -> None:
        """Stage parameter `index`'s gradient (zeros if it has none); send full buckets."""
        param = self.params[index]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        flat = grad.detach().reshape(-1).to("cpu")
        for server, b, key in self.by_param[index]:
            bucket = self.plan.shards[server].buckets[b]
            if bucket.numel == key.numel and len(key.ranges) == 1:
                # A bucket that is one slice of one gradient goes out without a copy.
                payload = protocol.gather_key(flat, key.ranges)
            else:
                staged = self.staging[server][key.offset : key.offset + key.numel]
                staged.copy_(protocol.gather_key(flat, key.ranges))
                payload = self.staging[server][bucket.offset : bucket.offset + bucket.numel]
            self.missing[server][b] -= 1
            if self.missing[server][b] == 0:
                self._request(server, Op.PUSH, b)
                self.sends.append((protocol.send(payload, self.servers[server], PAYLOAD), payload))
        self.pushed.add(index)

    def commit(self, lrs: list[float]) -> None:
        """End the step: push what is missing, commit with `lrs` and post the gated pull."""
        self.wait_pulls()
        for index in range(len(self.params)):
            if index not in self.pushed:
                self.push(index)
        self.pushed.clear()
        self.missing = [list(sizes) for sizes in self.bucket_sizes]
        for s in range(len(self.servers)):
            self._request(s, Op.COMMIT, self.versions[s], lrs=lrs)
            self._post_pull(s)
        self._drain_sends()

    # -- pull ------------------------------------------------------------------------------
    def _post_pull(self, s: int) -> None:
        # One pull per server is in flight at a time, so its buffers are reused.
        version, values = self.pull_buffers[s]
        server = self.servers[s]
        self.pulls.append(
            (
                s,
                protocol.recv(version, server, REPLY),
                version,
                protocol.recv(values, server, REPLY),
                values,
            )
        )

    @torch.no_grad()
    def wait_pulls(self) -> None:
        """Wait for the posted pulls and write the new parameters into the model."""
        pulls, self.pulls = self.pulls, []
        for s, version_work, version, values_work, values in pulls:
            what = f"Worker {self.rank} pulling parameters from server {s}"
            protocol.wait(version_work, self.timeout_s, what)
            protocol.wait(values_work, self.timeout_s, what)
            self.versions[s] = int(version.item())
            for key in self.plan.shards[s].keys:
                param = self.params[key.param]
                piece = values[key.offset : key.offset + key.numel]
                flat = param.data.reshape(-1)
                if flat.data_ptr() == param.data.data_ptr() and flat.device.type == "cpu":
                    protocol.scatter_key(flat, key.ranges, piece)
                else:
                    staged = flat.to("cpu").clone()
                    protocol.scatter_key(staged, key.ranges, piece)
                    param.data.copy_(staged.view_as(param))

    def pull_latest(self) -> None:
        """Fetch the servers' current parameters now (evaluation, checkpoints)."""
        self.wait_pulls()
        for s in range(len(self.servers)):
            self._request(s, Op.PULL)
            self._post_pull(s)
        self._drain_sends()
        self.wait_pulls()

    # -- state, statistics, end ------------------------------------------------------------
    def fetch_state(self) -> list[dict[int, dict[str, Any]]]:
        """Each server's optimizer state, by key index."""
        self.wait_pulls()
        states = []
        for s in range(len(self.servers)):
            self._request(s, Op.GET_STATE)
            self._drain_sends()
            size = torch.empty(1, dtype=torch.int64)
            self._wait_reply(size, s)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self._wait_reply(data, s)
            states.append(protocol.from_bytes(data))
        return states

    def set_state(self, s: int, payload: dict[str, Any]) -> None:
        """Replace server `s`'s parameters and optimizer state; wait until it has them."""
        self.wait_pulls()
        data = protocol.to_bytes(payload)
        self._request(s, Op.SET_STATE, data.numel())
        self.sends.append((protocol.send(data, self.servers[s], PAYLOAD), data))
        self._drain_sends()
        self._wait_reply(torch.empty(1), s)

    def stats(self) -> list[dict[str, float]]:
        """Each server's counters (protocol.STATS)."""
        self.wait_pulls()
        result = []
        for s in range(len(self.servers)):
            self._request(s, Op.STATS)
            self._drain_sends()
            counters = torch.empty(len(protocol.STATS), dtype=torch.float64)
            self._wait_reply(counters, s)
            result.append(dict(zip(protocol.STATS, counters.tolist(), strict=True)))
        return result

    def pause(self, paused: bool = True) -> None:
        """Tell every server this worker stops stepping (or, with False, steps again).

        Returns once every server has received it (a gloo send completes then).
        """
        for s in range(len(self.servers)):
            self._request(s, Op.PAUSE if paused else Op.RESUME)
        self._drain_sends()

    def finish(self) -> None:
        """Tell every server this worker is done (once)."""
        if self.finished:
            return
        self.finished = True
        self.wait_pulls()
        for s in range(len(self.servers)):
            self._request(s, Op.FINISH)
        self._drain_sends()
        for hook in self.hooks:
            hook.remove()

    # -- transport -------------------------------------------------------------------------
    def _request(
        self, s: int, op: Op, a: float = 0, b: float = 0, lrs: list[float] | None = None
    ) -> None:
        head = protocol.header(op, self.rank, a, b, lrs, self.groups)
        self.sends.append((protocol.send(head, self.servers[s], HEADER), head))

    def _drain_sends(self) -> None:
        sends, self.sends = self.sends, []
        for work, _ in sends:
            protocol.wait(work, self.timeout_s, f"Worker {self.rank} sending to a server")

    def _wait_reply(self, tensor: torch.Tensor, s: int) -> None:
        work = protocol.recv(tensor, self.servers[s], REPLY)
        protocol.wait(work, self.timeout_s, f"Worker {self.rank} waiting for server {s}")
