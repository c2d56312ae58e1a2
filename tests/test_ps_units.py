"""Parameter-server pieces that need no processes: sharding balance and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.models import MODELS, build
from dtrain.strategies.ps import protocol, sharding
from dtrain.strategies.ps.optimizer import check_optimizer


def plan_for(model: torch.nn.Module, servers: int) -> sharding.Plan:
    sizes = [p.numel() for p in model.parameters()]
    return sharding.plan(sizes, [0] * len(sizes), servers)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("servers", [1, 2, 3, 4, 8])
def test_bytes_are_balanced_over_the_servers(name: str, servers: int) -> None:
    model = build(name)
    plan = plan_for(model, servers)
    assert plan.balance <= 1.1, plan.bytes_per_server
    assert sum(plan.bytes_per_server) == 4 * sum(p.numel() for p in model.parameters())
    # Every element of every parameter is on exactly one server.
    for index, param in enumerate(model.parameters()):
        covered = sorted(
            r
            for shard in plan.shards
            for key in shard.keys
            if key.param == index
            for r in key.ranges
        )
        assert sum(length for _, length in covered) == param.numel()
        assert all(a[0] + a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


def test_large_tensors_are_cut_into_chunks_of_at_most_4_mib() -> None:
    plan = sharding.plan([3_000_000, 10], [0, 0], servers=2)
    ranges = [r for shard in plan.shards for key in shard.keys for r in key.ranges]
    assert max(length for _, length in ranges) * 4 <= 4 << 20
    assert plan.balance <= 1.1


def test_keys_round_trip_through_gather_and_scatter() -> None:
    flat = torch.arange(10.0)
    ranges = ((0, 3), (6, 2))
    piece = protocol.gather_key(flat, ranges)
    assert piece.tolist() == [0, 1, 2, 6, 7]
    out = torch.zeros(10)
    protocol.scatter_key(out, ranges, piece)
    assert out.tolist() == [0, 1, 2, 0, 0, 0, 6, 7, 0, 0]
    state = {"step": torch.tensor(3.0), "buf": torch.ones(2), "name": "x"}
    assert protocol.from_bytes(protocol.to_bytes(state)).keys() == state.keys()


def test_more_servers_than_chunks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"fewer than the 3 servers.*--servers 2 or fewer"):
        sharding.plan([200, 10], [0, 0], servers=3)


def test_bad_ps_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="needs at least one server.*--servers 1"):
        Config(strategy="ps", servers=0)
    with pytest.raises(ConfigError, match="--staleness .* add --ps-mode ssp"):
        Config(strategy="ps", staleness=2)
    with pytest.raises(ConfigError, match=r"--backup-workers must lie in \[0, --nproc\)"):
        Config(strategy="ps", nproc=2, backup_workers=2)
    with pytest.raises(ConfigError, match="--ps-mode must be one of sync, async, ssp"):
        Config(strategy="ps", ps_mode="eventual")
    with pytest.raises(ConfigError, match="--backup-workers applies to --ps-mode sync"):
        Config(strategy="ps", nproc=3, ps_mode="async", backup_workers=1)


def test_an_optimizer_the_servers_cannot_run_is_named() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    check_optimizer(torch.optim.Adam(params))
    with pytest.raises(ConfigError, match="cannot run LBFGS.*element-wise.*--strategy ddp"):
        check_optimizer(torch.optim.LBFGS(params))
    with pytest.raises(ConfigError, match="needs an optimizer"):
        check_optimizer(None)


def test_ps_without_its_servers_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs 3 processes, but this job has 1"):
        dtrain.init(strategy="ps", nproc=2, servers=1)


def test_the_command_line_refuses_zero_servers(tmp_path: Path) -> None:
    proc = run_cli("demo", "--strategy", "ps", "--servers", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "needs at least one server" in proc.stderr
