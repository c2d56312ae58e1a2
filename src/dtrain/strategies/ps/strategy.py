"""`ps`: workers compute gradients, parameter servers hold the parameters and update them.

The seeds' TensorFlow PS architecture on torch.distributed point-to-point messages over
gloo. `--nproc W` workers are global ranks 0..W-1 and read the data; `--servers K` servers
are the last K ranks, hold the parameters and optimizer state on the CPU, and run the
user's script only up to `engine.setup`, which serves until every worker has finished
and then ends the process with exit code 0. See server.py for the sync, async and ssp
rules and sharding.py for the placement.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.observe.logs import LOGGER
from dtrain.strategies.base import Strategy, register
from dtrain.strategies.ps import sharding, state
from dtrain.strategies.ps.client import Client
from dtrain.strategies.ps.optimizer import WorkerOptimizer, check_optimizer
from dtrain.strategies.ps.server import Server
from dtrain.topology import Topology, detect


@register
class ParameterServer(Strategy):
    """Data parallel against K CPU parameter servers (sync, async or bounded staleness)."""

    name = "ps"
    multiprocess = True
    state_by_module = False
    order = 30

    def __init__(self, config: Config, topology: Topology) -> None:
        super().__init__(config, topology)
        self.workers = topology.world_size - config.servers
        self.client: Client | None = None
        self.optimizer: WorkerOptimizer | None = None
        self.plan: sharding.Plan | None = None
        self._workers_group: dist.ProcessGroup | None = None

    # -- layout ----------------------------------------------------------------------------
    @classmethod
    def processes_per_node(cls, config: Config) -> int:
        return config.nproc + config.servers

    @classmethod
    def role_of(cls, config: Config, rank: int) -> str:
        if rank < config.nproc:
            return f"worker {rank}"
        return f"server {rank - config.nproc}"

    @classmethod
    def check_launch(cls, config: Config) -> None:
        if config.nnodes != 1:
            raise ConfigError(
                "--strategy ps runs on one machine in this version (workers and servers on "
                f"the same node), but --nnodes {config.nnodes} was given; use --nnodes 1."
            )

    @classmethod
    def detect_topology(cls, config: Config) -> Topology:
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != config.nproc + config.servers:
            raise ConfigError(
                f"--strategy ps with --nproc {config.nproc} workers and --servers "
                f"{config.servers} needs {config.nproc + config.servers} processes, but this "
                f"job has {world}; start it with `dtrain run --strategy ps --nproc W "
                "--servers K`, which adds the servers."
            )
        server = int(os.environ.get("RANK", 0)) >= config.nproc
        topology = detect(config.replace(cpu=True) if server else config)
        # The servers' messages go over gloo (CPU tensors, receive from any source).
        return dataclasses.replace(topology, backend="gloo")

    @property
    def is_server(self) -> bool:
        """True on the last K ranks."""
        return self.topology.rank >= self.workers

    @property
    def dp_size(self) -> int:
        return self.workers

    @property
    def dp_rank(self) -> int:
        return 0 if self.is_server else self.topology.rank

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._workers_group

    @property
    def lockstep(self) -> bool:
        """False: workers meet only through the servers. A collective among them at the
        loss reads could wait on a worker whose round the servers are still filling
        (backup workers, async, ssp); each worker checks its own loss."""
        return False

    # -- setup -----------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        check_optimizer(optimizer)
        assert optimizer is not None
        model = model.to(self.topology.device)
        params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        groups = [i for i, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self.plan = sharding.plan(
            [p.numel() for p in params], groups, self.config.servers, params[0].element_size()
        )
        self._broadcast_initial(model, params)
        # Every rank takes part in creating a group, servers included.
        self._workers_group = dist.new_group(list(range(self.workers)))
        if self.is_server:
            self._serve(optimizer, params)
        self.model = model
        self.client = Client(
            self.plan,
            params,
            self.topology.rank,
            self.workers,
            len(optimizer.param_groups),
            self.config.timeout_s,
        )
        self.optimizer = WorkerOptimizer(optimizer, self.client.commit, self._fetch_state)
        model.register_forward_pre_hook(lambda *_: self._wait_pulls())
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
        return model, self.optimizer

    def _broadcast_initial(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        """Worker 0's parameters and buffers to every rank, so all start equal."""
        tensors = [*params, *model.buffers()]
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _serve(self, optimizer: Optimizer, params: list[nn.Parameter]) -> None:
        assert self.plan is not None
        index = self.topology.rank - self.workers
        flat = [p.detach().reshape(-1).cpu() for p in params]
        server = Server(index, self.plan.shards[index], flat, optimizer, self.workers, self.config)
        server.serve()
        del server
        dist.destroy_process_group()
        sys.exit(0)

    # -- training --------------------------------------------------------------------------
    def _wait_pulls(self) -> None:
        if self.client is not None:
            self.client.wait_pulls()

    @property
    def _client(self) -> Client:
        assert self.client is not None, "engine.setup has not run"
        return self.client

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        client = self._client
        client.syncing = False
        try:
            yield
        finally:
            client.syncing = True

    def unwrap(self) -> nn.Module:
        self._wait_pulls()
        return super().unwrap()

    def eval_module(self) -> nn.Module:
        self._refresh()
        return super().unwrap()

    def _settle(self) -> None:
        """Return once the servers have taken in every worker's committed steps.

        A worker's pull is answered only after its commit was handled, so once every
        worker has its pull and has passed the barrier, no commit is in flight. The pause
        comes first: with backup workers a round may wait for a gradient that workers
        standing at this barrier will not send; paused, they let the server drop it.
        """
        self._client.pause()
        self._client.wait_pulls()
        dist.barrier(group=self._workers_group)

    def _resume(self) -> None:
        """End a `_settle`: every server knows every worker steps again before any does."""
        self._client.pause(False)
        dist.barrier(group=self._workers_group)

    def _refresh(self) -> None:
        """Every worker reads the servers' parameters after all committed steps."""
        self._settle()
        self._client.pull_latest()
        self._resume()

    # -- checkpoints -----------------------------------------------------------------------
    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """Bring every worker to the servers' parameters, then the main rank's state
        (the worker optimizer's state_dict fetches the servers' optimizer state)."""
        self.gather_state()
        return super().full_state(optimizer)

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        """Load on the workers, then hand parameters and optimizer state to the servers."""
        skipped = super().load_full_state(tensors, optimizer, optimizer_state, strict)
        self.after_load()
        return skipped

    def gather_state(self) -> None:
        self._refresh()

    def _fetch_state(self) -> dict[int, dict[str, Any]]:
        """The servers' optimizer state as whole tensors, by parameter position."""
        assert self.plan is not None
        return state.merge(self.plan, self._client.params, self._client.fetch_state())

    def after_load(self) -> None:
        """Worker 0 sends the loaded parameters and optimizer state to every server."""
        assert self.plan is not None and self.optimizer is not None
        self._settle()
        if self.topology.is_main:
            loaded = self.optimizer.loaded_state or {}
            for s, shard in enumerate(self.plan.shards):
                self._client.set_state(s, state.split(shard, self._client.params, loaded))
        self.optimizer.loaded_state = None
        self._resume()

    # -- measurements and end --------------------------------------------------------------
    def report(self) -> dict[str, object]:
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
