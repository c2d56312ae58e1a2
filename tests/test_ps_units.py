"""Parameter-server pieces that need no processes: sharding balance, flat parameter
storage, checkpoint state round trips and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.models import MODELS, build
from dtrain.process.topology import Topology
from dtrain.strategies.ps import protocol, sharding, state_shards
from dtrain.strategies.ps.optimizer import GroupSettings, check_optimizer
from dtrain.strategies.ps.storage import FlatParameters
from dtrain.strategies.rebuild import hyperparameters
from dtrain.strategies.specs import lookup


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
    # The buckets tile the workers' flat buffer, each bucket is tiled by its keys, and
    # every element of every parameter is in exactly one key.
    buckets = sorted((b for s in plan.shards for b in s.buckets), key=lambda b: b.start)
    assert buckets[0].start == 0
    assert all(a.start + a.numel == b.start for a, b in zip(buckets, buckets[1:], strict=False))
    for shard in plan.shards:
        for bucket in shard.buckets:
            keys = [shard.keys[k] for k in bucket.keys]
            assert keys[0].offset == bucket.offset
            assert sum(k.numel for k in keys) == bucket.numel
            for key in keys:
                assert (
                    plan.offsets[key.param] + key.start == bucket.start + key.offset - bucket.offset
                )
    for index, param in enumerate(model.parameters()):
        covered = sorted(
            (key.start, key.numel)
            for shard in plan.shards
            for key in shard.keys
            if key.param == index
        )
        assert sum(length for _, length in covered) == param.numel()
        assert all(a[0] + a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


def test_buckets_are_at_most_4_mib() -> None:
    plan = sharding.plan([3_000_000, 10], [0, 0], servers=2)
    assert max(b.numel for shard in plan.shards for b in shard.buckets) * 4 <= 4 << 20
    assert plan.balance <= 1.1
    one = sharding.plan([3_000_000, 10], [0, 1], servers=1)
    assert [b.numel for b in one.shards[0].buckets] == [1 << 20, 1 << 20, 3_000_010 - (2 << 20)]
    assert [k.group for k in one.shards[0].keys] == [0, 0, 0, 1]


def test_flat_parameters_keep_values_and_publish_pulls_without_copies() -> None:
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    store = FlatParameters(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert params[0].data_ptr() == store.current.data_ptr()
    store.landing(0, 8).copy_(torch.arange(8.0))
    incoming = store.incoming.data_ptr()
    store.publish()
    assert params[0].data_ptr() == incoming  # the parameters now use the landed buffer
    assert params[0].tolist() == [[0, 1, 2], [3, 4, 5]] and params[1].tolist() == [6, 7]
    assert model(torch.ones(1, 3)).tolist() == [[9, 19]]


def test_checkpoint_state_round_trips_through_the_servers_keys() -> None:
    params = [torch.nn.Parameter(torch.randn(300, 3)), torch.nn.Parameter(torch.randn(7))]
    plan = sharding.plan([p.numel() for p in params], [0, 1], servers=3)
    values = torch.cat([p.detach().reshape(-1) for p in params])
    loaded = {
        0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(300, 3)},
        1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7)},
    }
    parts = [state_shards.split(shard, values, params, loaded) for shard in plan.shards]
    for shard, part in zip(plan.shards, parts, strict=True):
        for bucket in shard.buckets:
            got = part["params"][bucket.offset : bucket.offset + bucket.numel]
            assert torch.equal(got, values[bucket.start : bucket.start + bucket.numel])
    merged = state_shards.merge(plan, params, [part["state"] for part in parts])
    for index, values_of in loaded.items():
        for name, value in values_of.items():
            assert torch.equal(merged[index][name], value), (index, name)
    assert state_shards.split(plan.shards[0], values, params, None)["state"] is None


def test_protocol_bytes_round_trip() -> None:
    payload = {"step": torch.tensor(3.0), "buf": torch.ones(2), "name": "x"}
    assert protocol.from_bytes(protocol.to_bytes(payload)).keys() == payload.keys()


def test_more_servers_than_buckets_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"fewer than the 3 servers.*--servers 2 or fewer"):
        sharding.plan([300, 10], [0, 0], servers=3)


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


def test_every_numeric_group_setting_travels_in_its_type() -> None:
    """What a commit carries: lr, betas, eps, weight_decay, the flags (bools stay bools);
    keys a scheduler adds after setup stay behind; None settings cannot travel."""
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}])
    settings = GroupSettings([hyperparameters(group) for group in optimizer.param_groups])
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=4)
    decoded = settings.decode(settings.encode(optimizer.param_groups))
    for group, values in zip(optimizer.param_groups, decoded, strict=True):
        assert values == {k: group[k] for k in values}
        assert isinstance(values["betas"], tuple) and isinstance(values["amsgrad"], bool)
        assert "initial_lr" not in values and "foreach" not in values
    assert decoded[0]["betas"] == (0.95, 0.999)  # OneCycleLR starts beta1 at its maximum
    optimizer.param_groups[1]["foreach"] = True
    with pytest.raises(ConfigError, match="group 1's setting 'foreach' is now True, but was None"):
        settings.encode(optimizer.param_groups)
    optimizer.param_groups[1]["foreach"] = None
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ConfigError, match="has 3 param groups, but had 2 at engine.setup"):
        settings.encode(optimizer.param_groups)


def test_ps_without_its_servers_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs 3 processes, but this job has 1"):
        dtrain.init(strategy="ps", nproc=2, servers=1)


def test_a_server_rank_running_the_script_is_told_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A script started on a server rank by another launcher (plain torchrun) stops at
    dtrain.init, before joining the job, naming `dtrain run --strategy ps`."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(
        ConfigError, match=r"Rank 2 is a parameter server.*dtrain run --strategy ps"
    ):
        dtrain.init(strategy="ps", nproc=2, servers=1)


@pytest.mark.parametrize(
    ("options", "lockstep"),
    [
        ({}, True),
        ({"ps_mode": "async"}, False),
        ({"ps_mode": "ssp"}, False),
        ({"nproc": 3, "backup_workers": 1}, False),
    ],
)
def test_only_sync_rounds_without_backups_read_losses_collectively(
    options: dict[str, object], lockstep: bool
) -> None:
    """A collective loss read would hold a fast async worker to the slowest one's pace."""
    config = Config(strategy="ps", **{"nproc": 2, "servers": 1, **options})  # type: ignore[arg-type]
    where = Topology(0, config.nproc + 1, 0, config.nproc + 1, torch.device("cpu"), "gloo")
    assert lookup("ps").build(config, where).placement.coupling.lockstep is lockstep


def test_workers_run_the_script_and_servers_their_role() -> None:
    config = Config(strategy="ps", nproc=2, servers=1)
    assert lookup("ps").role_main(config, 1) is None
    assert callable(lookup("ps").role_main(config, 2))


def test_the_command_line_refuses_zero_servers(tmp_path: Path) -> None:
    proc = run_cli("demo", "--strategy", "ps", "--servers", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "needs at least one server" in proc.stderr
