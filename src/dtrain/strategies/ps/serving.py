"""What a server rank runs in place of the user's script (the launcher calls it)."""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.process.rng import initial_seeds
from dtrain.process.topology import Topology, detect, init_process_group
from dtrain.strategies.ps.handshake import handshake
from dtrain.strategies.ps.roles import Roles
from dtrain.strategies.ps.server import Server


def topology(config: Config, server: bool) -> Topology:
    """A worker's or server's topology; servers compute on the CPU, and every message of
    the job goes over gloo (CPU tensors, receives from any source).

    Raises:
        ConfigError: the job does not have W + K processes.
    """
    world = int(os.environ.get("WORLD_SIZE", 1))
    expected = Roles.of(config).world_size
    if world != expected:
        raise ConfigError(
            f"--strategy ps with --nproc {config.nproc} workers per machine, --nnodes "
            f"{config.nnodes} and --servers {config.servers} needs {expected} processes, but "
            f"this job has {world}; start it with `dtrain run --strategy ps --nproc W "
            "--servers K`, which adds the servers."
        )
    found = detect(config.replace(cpu=True) if server else config)
    return dataclasses.replace(found, backend="gloo")


def serve(config: Config) -> None:
    """A server's whole run: join the job, serve it (:func:`serve_job`), leave the
    process group."""
    init_process_group(topology(config, server=True), config.timeout_s)
    try:
        serve_job(config)
    finally:
        dist.destroy_process_group()


def serve_job(config: Config) -> None:
    """Serve one training run on the joined process group: take part in the gather of
    seeds that the workers' `dtrain.init` makes over the whole job, receive the model's
    description and initial values from worker 0's `engine.setup`, then answer the
    workers until every one has finished."""
    initial_seeds(everyone=True)
    roles = Roles.of(config)
    start = handshake(None, None, roles)
    index = roles.index(dist.get_rank())
    shard = start.description.plan(config.servers).shards[index]
    server = Server(index, shard, start, config)
    del start  # the server copied its shard of the values
    server.serve()
