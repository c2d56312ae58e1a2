"""`ps`: workers compute gradients, parameter servers hold the parameters and update them.

TensorFlow's parameter-server architecture on torch.distributed point-to-point messages over
gloo. `--nproc` workers per machine run the user's script and read the data; `--servers
K` servers in all, K/N on each of the N machines, hold the parameters and optimizer state
on the CPU (roles.py says which rank is which). The launcher runs what a server rank's
`role_main` gives (the ps spec in strategies/specs.py: serving.py) instead of the script:
it learns the model from worker 0's `engine.setup` (handshake.py), serves until every
worker has finished and returns. See server.py for the sync, async and ssp rules and
sharding.py for the placement.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.broadcast import broadcast_tensors
from dtrain.parallel.clip import global_grad_norm
from dtrain.parallel.preparation import unwrap
from dtrain.parallel.sync_batchnorm import convert_sync_batchnorm
from dtrain.process.logs import LOGGER
from dtrain.process.topology import Topology
from dtrain.step.batches import LossFn, Weight
from dtrain.strategies.base import Strategy
from dtrain.strategies.placement import Coupling
from dtrain.strategies.ps import sharding, state_shards
from dtrain.strategies.ps.client import Client
from dtrain.strategies.ps.handshake import Description, handshake
from dtrain.strategies.ps.optimizer import GroupSettings, WorkerOptimizer, check_optimizer
from dtrain.strategies.ps.roles import Roles
from dtrain.strategies.ps.storage import FlatParameters
from dtrain.strategies.specs import NO_BACKUP_CLIPPING, StrategySpec


class ParameterServer(Strategy):
    """Data parallel against K CPU parameter servers (sync, async or bounded staleness)."""

    def __init__(self, config: Config, topology: Topology, spec: StrategySpec) -> None:
        super().__init__(config, topology, spec)
        self.roles = Roles.of(config)
        self.workers = self.roles.workers
        self.client: Client | None = None
        self.optimizer: WorkerOptimizer | None = None
        self.plan: sharding.Plan | None = None
        # Only sync rounds without backup workers hold every worker to the same step, and
        # apply the mean of every worker's gradient. In async and ssp, and with backup
        # workers, a worker may run ahead of a slower one: a collective read of a per-step
        # value (the Engine's loss) would make it wait for the slowest, undoing what those
        # modes are for.
        whole_rounds = config.ps_mode == "sync" and config.backup_workers == 0
        self.placement = replace(
            self.placement,
            dp_size=self.workers,
            dp_rank=self.roles.index(topology.rank),
            splits_model=True,
            coupling=Coupling(lockstep=whole_rounds, averages_gradients=whole_rounds),
        )
        """The workers' group (`dp_group`, `train_group`) exists once `setup`'s handshake
        made it; until then they are None."""
        self._fresh = False
        """True while this worker holds the servers' latest parameters (refreshed or
        loaded, no step committed since)."""
        self._clip = 0.0
        """What the next COMMIT asks the servers to clip by (0: nothing): the bound
        (sync), or the factor for this worker's gradient (async, ssp)."""
        self._holding = False
        """Inside `no_sync`: the micro-batch's gradients are not final yet."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clipping happens where the update is made. Sync: the servers clip the round's
        mean gradient by its global norm (they add up their shards' squares), so the
        update is `single`'s; the norm stays on the servers and NaN is returned. Async and
        ssp: each update is one worker's gradient, whose norm this worker computes; the
        servers scale that gradient by min(1, max_norm / norm) before applying it."""
        if self.config.backup_workers:
            raise ConfigError(NO_BACKUP_CLIPPING)
        if self.config.ps_mode == "sync":
            self._clip = max_norm
            return torch.full((), float("nan"))
        norm, _ = global_grad_norm(self.unwrap().parameters())
        self._clip = float((max_norm / (norm + 1e-6)).clamp(max=1.0))  # the pushes are on the host
        return norm

    @property
    def state_by_module(self) -> bool:
        """The servers hold the optimizer state; the worker's optimizer only forwards."""
        return False

    # -- setup ---------------------------------------------------------------------------
    def wrap(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        check_optimizer(optimizer)
        assert optimizer is not None
        model, preparation = unwrap(model, self.config)
        model = model.to(self.topology.device)
        preparation.checkpoint(model)  # first: a refusal comes before the servers are told
        params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        store = FlatParameters(params)
        start = handshake(Description.of(optimizer), store.host(), self.roles)
        store.assign(start.values)
        # The workers read the data and run the loop; the servers do neither.
        workers = start.workers
        self.placement = replace(self.placement, dp_group=workers, train_group=workers)
        self._broadcast_rest(model, params)
        if self.config.sync_batchnorm:  # the same parameter and buffer objects, regrouped
            model = convert_sync_batchnorm(model, self.placement.dp_group, self.topology.device)
        self.plan = start.description.plan(self.config.servers)
        self.model = model
        preparation.compile_blocks(model)
        settings = GroupSettings(start.description.settings)
        self.client = Client(
            self.plan,
            store,
            start.channel,
            self.placement.dp_rank,
            self.roles.server_ranks,
            settings.width,
            self.config.ps_mode == "sync" and self.workers > 1,
            self.config.timeout_s,
        )
        self.optimizer = WorkerOptimizer(optimizer, settings, self._commit, self._fetch_state)
        # The step's own data dependency: a forward computes on the pulled parameters.
        model.register_forward_pre_hook(lambda *_: self._client.wait_pulls())
        atexit.register(self._finish_at_exit)
        if self.topology.is_main:
            sizes = ", ".join(f"{b / 1024:.1f} KiB" for b in self.plan.bytes_per_server)
            LOGGER.info(
                "ps: %d workers, %d servers, mode %s; bytes per server: %s (max/mean %.3f)",
                self.workers,
                self.config.servers,
                self.config.ps_mode,
                sizes,
                self.plan.balance,
            )
        self._fresh = True  # every worker and server holds worker 0's values
        return model, self.optimizer

    def _broadcast_rest(self, model: nn.Module, served: list[nn.Parameter]) -> None:
        """Worker 0's buffers and unserved parameters to every worker, bit for bit, so all
        start equal (the servers sent the served ones in the handshake)."""
        ids = {id(p) for p in served}
        tensors = [p for p in model.parameters() if id(p) not in ids] + list(model.buffers())
        # Every message of a ps job goes over gloo, which sends host memory.
        broadcast_tensors(tensors, self.placement.dp_group, torch.device("cpu"))

    # -- training --------------------------------------------------------------------------
    @property
    def _client(self) -> Client:
        assert self.client is not None, "engine.setup has not run"
        return self.client

    def _commit(self, settings: list[float]) -> None:
        self._fresh = False
        clip, self._clip = self._clip, 0.0
        self._client.commit(settings, clip)

    def forward_backward(self, batch: Any, loss_fn: LossFn | None, scale: Weight) -> torch.Tensor:
        """`engine.train_step`'s forward and backward: between its last backward of a step
        and its optimizer step nothing changes a gradient (under ps `clip_grad_norm_` only
        measures), so that backward pushes each bucket as it completes it. Everywhere else
        the optimizer's step pushes, after whatever the script did to the gradients."""
        client = self._client
        client.early = not self._holding
        try:
            return super().forward_backward(batch, loss_fn, scale)
        finally:
            client.early = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def _settle(self) -> None:
        """Return once the servers have taken in every worker's committed steps.

        A worker's pull is answered only after its commit was handled, so once every
        worker has its pull and has passed the barrier, no commit is in flight. The pause
        comes first: with backup workers a round may wait for a gradient that workers
        standing at this barrier will not send; paused, they let the server drop it.
        """
        self._client.pause()
        self._client.wait_pulls()
        dist.barrier(group=self.placement.dp_group)

    def _resume(self) -> None:
        """End a `_settle`: every server knows every worker steps again before any does."""
        self._client.pause(False)
        dist.barrier(group=self.placement.dp_group)

    def refresh(self) -> None:
        """Every worker reads the servers' parameters after all committed steps
        (collective over the workers). Between steps a worker's module holds the values
        its last forward used, or the pulled ones once its next forward has begun."""
        self._settle()
        self._client.pull_latest()
        self._resume()
        self._fresh = True

    # -- checkpoints -----------------------------------------------------------------------
    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """The servers' latest parameters and optimizer state, on the main rank (the
        worker optimizer's state_dict fetches the servers' optimizer state).

        Refreshes first unless the caller just did: every worker has taken the same steps
        since its last refresh, so all of them decide alike.
        """
        if not self._fresh:
            self.refresh()
        return super().full_state(optimizer)

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        """Load on the workers; worker 0 then sends the loaded parameters and optimizer
        state to every server (the servers keep their optimizer state when none was
        loaded)."""
        assert self.plan is not None and self.optimizer is not None
        self._settle()  # no pull may land over the loaded values
        skipped = super().load_full_state(tensors, optimizer, optimizer_state, strict)
        if self.topology.is_main:
            values = self._client.store.host()
            loaded = self.optimizer.loaded_state
            for s, shard in enumerate(self.plan.shards):
                payload = state_shards.split(shard, values, self._client.params, loaded)
                self._client.set_state(s, payload)
        self.optimizer.loaded_state = None
        self._resume()
        self._fresh = True
        return skipped

    def _fetch_state(self) -> dict[int, dict[str, Any]]:
        """The servers' optimizer state as whole tensors, by parameter position."""
        assert self.plan is not None
        return state_shards.merge(self.plan, self._client.params, self._client.fetch_state())

    # -- measurements and end --------------------------------------------------------------
    def figures(self) -> dict[str, object]:
        """Counters of the servers, on the main rank (every worker must call it)."""
        if self.client is None or self.plan is None:
            return {}
        self._settle()
        stats = self.client.stats() if self.topology.is_main else []
        self._resume()
        if not stats:
            return {}
        applied = sum(s["applied"] for s in stats)
        return {
            "ps_mode": self.config.ps_mode,
            "ps_servers": self.config.servers,
            "ps_bytes_per_server": self.plan.bytes_per_server,
            "ps_balance": self.plan.balance,
            "ps_updates": [int(s["updates"]) for s in stats],
            "ps_gradients_per_update": [
                int(min(s["min_used"] for s in stats)),
                int(max(s["max_used"] for s in stats)),
            ],
            "ps_gradients_used": [int(s["used"]) for s in stats],
            "ps_dropped_gradients": int(sum(s["dropped"] for s in stats)),
            "ps_pending_gradients": int(sum(s["pending"] for s in stats)),
            "ps_max_step_gap": int(max(s["max_gap"] for s in stats)),
            "ps_max_staleness": int(max(s["max_staleness"] for s in stats)),
            "ps_mean_staleness": sum(s["staleness_sum"] for s in stats) / applied
            if applied
            else 0.0,
        }

    def _finish_at_exit(self) -> None:
        if self.client is not None and dist.is_initialized():
            self.client.finish()

    def close(self) -> None:
        if self.client is not None:
            self.client.finish()
            atexit.unregister(self._finish_at_exit)
        self.model = None
