"""The worker's side of the parameter server: push gradients, commit, pull parameters.

Gradients are pushed once they are final. `commit` (the optimizer's `step`) pushes every
bucket not sent yet, so what a loop written by hand does to the gradients between
backward and `optimizer.step()` (several backward passes accumulated without
`engine.no_sync()`, a scaling) is what the servers receive. Inside `engine.train_step`
nothing changes a gradient between its last backward and its step, so there the push
overlaps with backward, as in BytePS and PyTorch DDP (`early`): a hook on every trainable
parameter hands its gradient over as soon as backward has accumulated it, and a bucket
(a contiguous ~4 MiB range of the parameters, see sharding.py) is pushed the moment its
last gradient is in, while backward goes on with the layers below. A bucket inside one
parameter goes out straight from the gradient's storage; a bucket spanning several
parameters is staged in one buffer first.

In sync mode with several workers a worker's gradient is only its share of the round's
mean, so a change made to it after backward is not that change of the batch's gradient
(torch's `clip_grad_norm_` would clip by this worker's own norm, not by the norm of the
gradient `single` clips): the commit refuses gradients changed in place or replaced since
backward produced them. A parameter without a gradient (unused, frozen) is pushed as
zeros, and the commit tells the servers which parameters have none (server.py decides
which to step).

`commit` tells every server that this step's gradients are complete, with every param
group's settings, and posts the receives of the new parameters, bucket by bucket into the
landing buffer (storage.py), without waiting; the model's forward waits for them, so the
pull overlaps with loading the next batch. (In async mode a forward that did not wait at
all, computing on the parameters it had, added about one step of staleness and made the
demo diverge at momentum 0.9, so every mode waits for its pull.)
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.errors import ConfigError
from dtrain.strategies.ps import protocol
from dtrain.strategies.ps.protocol import HEADER, PAYLOAD, PUSH_TAGS, REPLY, Op
from dtrain.strategies.ps.sharding import Plan
from dtrain.strategies.ps.storage import FlatParameters

CHANGED_GRADIENT = (
    "A gradient was changed between backward and optimizer.step() (clipped with "
    "torch.nn.utils.clip_grad_norm_, or scaled or replaced by hand). Under --strategy ps in "
    "sync mode each worker holds only its share of the batch's gradient, so that change "
    "would not be the one single makes to the whole batch's gradient. Clip with "
    "engine.clip_grad_norm_(max_norm) (or --clip-grad-norm), which the servers apply to the "
    "round's mean gradient, and scale the loss rather than the gradients."
)


class Client:
    """One worker's connection to the K servers.

    Args:
        plan: where every bucket lives.
        store: the served parameters, in optimizer order, as views of one flat buffer.
        channel: the run's messages.
        rank: this worker's index in [0, W) (global rank 0 is worker 0).
        servers: the global rank of each server.
        width: the floats of the param groups' settings in each commit (GroupSettings).
        shared: this worker's gradient is one share of a sync round's (sync, W > 1): the
            commit refuses gradients changed since backward.
        timeout_s: how long any wait may last before the peer is declared dead.
    """

    def __init__(
        self,
        plan: Plan,
        store: FlatParameters,
        channel: protocol.Channel,
        rank: int,
        servers: list[int],
        width: int,
        shared: bool,
        timeout_s: float,
    ) -> None:
        self.plan = plan
        self.store = store
        self.channel = channel
        self.params = store.params
        self.rank = rank
        self.servers = servers
        self.width = width
        self.shared = shared
        self.timeout_s = timeout_s
        # The pieces of each parameter: (server, bucket, start in the parameter, numel,
        # start in the flat buffer); how many pieces each bucket still waits for this step.
        self.by_param: list[list[tuple[int, int, int, int, int]]] = [[] for _ in self.params]
        for s, shard in enumerate(plan.shards):
            for b, bucket in enumerate(shard.buckets):
                for key in shard.keys[bucket.keys.start : bucket.keys.stop]:
                    where = plan.offsets[key.param] + key.start
                    self.by_param[key.param].append((s, b, key.start, key.numel, where))
        self.bucket_sizes = [[len(b.keys) for b in shard.buckets] for shard in plan.shards]
        self.missing = [list(sizes) for sizes in self.bucket_sizes]
        self.staging = torch.empty_like(store.incoming)
        self.versions = [0] * len(self.servers)
        self.versions_in = [torch.zeros(1, dtype=torch.int64) for _ in self.servers]
        self.early = False
        """Push each bucket from the hooks as backward completes it (set by the strategy
        inside `engine.train_step`'s last backward of a step)."""
        self.pushed: set[int] = set()
        self.seen: dict[int, tuple[int, int]] = {}
        """The parameters backward gave a gradient since the last commit: the gradient's
        (storage address, version counter) when backward left it."""
        self.sends: list[tuple[Any, torch.Tensor, int]] = []
        """Sends not waited for yet: (work, the tensor it reads, the server's index)."""
        self.pulls: list[tuple[int, list[Any]]] = []
        self.finished = False
        # Frozen parameters get no hook (torch refuses one); they have no gradient to hand over.
        self.hooks = [
            p.register_post_accumulate_grad_hook(self._on_gradient)
            for p in self.params
            if p.requires_grad
        ]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    # -- push ------------------------------------------------------------------------------
    def _on_gradient(self, param: torch.Tensor) -> None:
        index = self._index[id(param)]
        grad = param.grad
        assert grad is not None  # backward has just accumulated it
        # Every in-place change of a tensor moves its version counter.
        self.seen[index] = (grad.data_ptr(), grad._version)
        if self.early:
            self.push(index)

    def push(self, index: int) -> None:
        """Hand over parameter `index`'s gradient (zeros if it has none); send full buckets."""
        grad = self.params[index].grad
        flat = grad.detach().reshape(-1) if grad is not None else None
        for server, b, start, numel, where in self.by_param[index]:
            bucket = self.plan.shards[server].buckets[b]
            if flat is not None and flat.device.type == "cpu" and numel == bucket.numel:
                # A bucket that is one slice of one gradient goes out without a copy.
                payload = flat[start : start + numel]
            else:
                staged = self.staging[where : where + numel]
                if flat is None:
                    staged.zero_()
                else:
                    staged.copy_(flat[start : start + numel])
                payload = self.staging[bucket.start : bucket.start + bucket.numel]
            self.missing[server][b] -= 1
            if self.missing[server][b] == 0:
                work = self.channel.send(payload, self.servers[server], PUSH_TAGS + b)
                self.sends.append((work, payload, server))
        self.pushed.add(index)

    def commit(self, settings: list[float], clip: float = 0.0) -> None:
        """End the step: push what is not pushed yet, commit with the param groups'
        `settings`, `clip` (see the protocol's COMMIT) and which parameters have a
        gradient, and post the gated pull.

        Raises:
            ConfigError: `shared`, and a gradient was changed since backward produced it.
        """
        self.wait_pulls()
        if self.shared:
            self._check_unchanged()
        present = [p.grad is not None for p in self.params]
        for index in range(len(self.params)):
            if index not in self.pushed:
                self.push(index)
        self.pushed.clear()
        self.seen.clear()
        self.missing = [list(sizes) for sizes in self.bucket_sizes]
        mask = None if all(present) else torch.tensor(present, dtype=torch.uint8)
        for s, server in enumerate(self.servers):
            masked = float(mask is not None)
            self._request(s, Op.COMMIT, self.versions[s], clip, masked, settings=settings)
            if mask is not None:
                self.sends.append((self.channel.send(mask, server, PAYLOAD), mask, s))
            self._post_pull(s)
        self._drain_sends()

    def _check_unchanged(self) -> None:
        """Refuse a gradient backward produced that was changed in place or replaced since
        (a gradient set to None counts as none, on any worker alike)."""
        for index, seen in self.seen.items():
            grad = self.params[index].grad
            if grad is not None and (grad.data_ptr(), grad._version) != seen:
                raise ConfigError(CHANGED_GRADIENT)

    # -- pull ------------------------------------------------------------------------------
    def _post_pull(self, s: int) -> None:
        # A reply is the version, then each bucket in order (gloo keeps the order of one
        # sender's messages on one tag); one pull per server is in flight at a time.
        server = self.servers[s]
        works = [self.channel.recv(self.versions_in[s], server, REPLY)]
        for bucket in self.plan.shards[s].buckets:
            landing = self.store.landing(bucket.start, bucket.numel)
            works.append(self.channel.recv(landing, server, REPLY))
        self.pulls.append((s, works))

    def wait_pulls(self) -> None:
        """Wait for the posted pulls, then make the new values the parameters'."""
        if not self.pulls:
            return
        pulls, self.pulls = self.pulls, []
        for s, works in pulls:
            what = f"Worker {self.rank} pulling parameters from server {s}"
            for work in works:
                self.channel.wait(work, self.timeout_s, what, self.servers[s])
            self.versions[s] = int(self.versions_in[s].item())
        self.store.publish()

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
        """Replace server `s`'s parameters (and optimizer state, unless the payload's
        state is None); wait until it has them."""
        self.wait_pulls()
        data = protocol.to_bytes(payload)
        self._request(s, Op.SET_STATE, data.numel())
        self.sends.append((self.channel.send(data, self.servers[s], PAYLOAD), data, s))
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
    def _request(self, s: int, op: Op, *fields: float, settings: list[float] | None = None) -> None:
        """Send server `s` a header: `fields` are its a, b, c (see protocol.py)."""
        head = protocol.header(op, self.rank, *fields, settings=settings, width=self.width)
        self.sends.append((self.channel.send(head, self.servers[s], HEADER), head, s))

    def _drain_sends(self) -> None:
        sends, self.sends = self.sends, []
        for work, _, s in sends:
            what = f"Worker {self.rank} sending to server {s}"
            self.channel.wait(work, self.timeout_s, what, self.servers[s])

    def _wait_reply(self, tensor: torch.Tensor, s: int) -> None:
        work = self.channel.recv(tensor, self.servers[s], REPLY)
        what = f"Worker {self.rank} waiting for server {s}"
        self.channel.wait(work, self.timeout_s, what, self.servers[s])
