"""Parameter servers across test hosts (network namespaces, tests/cluster.py): `--servers
K` counts the servers of the whole job, K/N on each machine, and every worker pushes to and
pulls from the servers of every host; sync ps on two hosts trains as one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cluster
import pytest
import torch
from test_multihost import STEPS, run_nodes
from torch.testing import assert_close
from training import train

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.strategies.ps.roles import Roles
from dtrain.strategies.specs import lookup


def test_servers_are_spread_over_the_machines_and_must_divide_evenly() -> None:
    """Ranks go node by node; each node's last ranks serve. One node keeps the old layout."""
    two = Config(strategy="ps", nproc=2, servers=4, nnodes=2, master="h1:1")
    roles = Roles.of(two)
    ps = lookup("ps")
    assert ps.processes_per_node(two) == 4
    assert (roles.worker_ranks, roles.server_ranks) == ([0, 1, 4, 5], [2, 3, 6, 7])
    assert [roles.index(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [ps.role_of(two, r) for r in (1, 2, 4, 7)] == [
        "worker 1",
        "server 0",
        "worker 2",
        "server 3",
    ]
    one = Roles.of(Config(strategy="ps", nproc=3, servers=2))
    assert (one.worker_ranks, one.server_ranks) == ([0, 1, 2], [3, 4])
    uneven = Config(strategy="ps", nproc=1, servers=3, nnodes=2, master="h1:1")
    with pytest.raises(ConfigError, match="--servers 3 cannot be spread evenly over --nnodes 2"):
        ps.check_launch(uneven)
    elastic = Config(strategy="ps", servers=2, nnodes=2, min_nnodes=1, master="h1:1")
    with pytest.raises(ConfigError, match="cannot run elastic"):
        ps.check_launch(elastic)


WHY_NOT = cluster.unavailable()


@pytest.fixture(scope="module")
def hosts() -> Iterator[cluster.Cluster]:
    """Two test hosts, dt-h1 and dt-h2, on links shaped to 1 Gbit/s."""
    with cluster.cluster(2, rate="1gbit") as made:
        yield made


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}")
@pytest.mark.timeout(180)
def test_sync_ps_with_a_server_on_each_host_equals_one_process(
    hosts: cluster.Cluster, tmp_path: Path
) -> None:
    """Two hosts x (1 worker + 1 server): each worker's gradient goes half to its own host's
    server and half across the link, and the parameters equal one process's."""
    flags = ("--strategy", "ps", "--nproc", "1", "--servers", "2")
    params: dict[str, torch.Tensor] = run_nodes(hosts, tmp_path, *flags)[0]
    assert_close(params, train(steps=STEPS, strategy="single"))
