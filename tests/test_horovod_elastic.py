"""Horovod's elastic API on dtrain: `ElasticSampler` reshards what is left of an epoch
over any world size; `TorchState` commits, restores, syncs and resumes from the job's
elastic folder on 2 gloo ranks; horovodrun's elastic flags map onto dtrain's launcher;
and a Horovod-style elastic script whose rank dies mid-epoch is restarted by horovodrun
and ends with the model of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from torch.testing import assert_close

import dtrain.horovod as hvd
from dtrain.horovod import basics
from dtrain.horovod.elastic import durable
from dtrain.horovod.elastic.sampler import ElasticSampler
from dtrain.horovod.run import main as horovodrun

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "horovod_elastic_digits.py"


def _samplers(monkeypatch: pytest.MonkeyPatch, size: int, state: dict | None) -> list:
    """One sampler per rank of a world of `size` (hvd's rank and size faked), each
    resumed from `state` when given."""
    samplers = []
    for rank in range(size):
        monkeypatch.setattr(basics, "size", lambda: size)
        monkeypatch.setattr(basics, "rank", lambda rank=rank: rank)
        sampler = ElasticSampler(list(range(48)), shuffle=True, seed=3)
        if state is not None:
            sampler.load_state_dict(state)
        samplers.append(sampler)
    return samplers


def test_elastic_sampler_reshards_the_rest_of_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    two = _samplers(monkeypatch, 2, None)
    order = [i for pair in zip(*(list(s) for s in two), strict=True) for i in pair]
    assert sorted(order) == list(range(48)) and order != list(range(48))
    for batch in range(3):  # 3 batches of 4 per rank: the first 24 of the epoch's order
        for sampler in two:
            sampler.record_batch(batch, 4)
    assert two[0].processed_indices == two[1].processed_indices == set(order[:24])
    state = two[0].state_dict()
    for size in (1, 3):
        resumed = _samplers(monkeypatch, size, state)
        assert [len(s) for s in resumed] == [24 // size] * size
        rest = [i for s in resumed for i in s]
        assert sorted(rest + order[:24]) == list(range(48))  # each index once in the epoch
        assert set(resumed[0].get_indices(0, 2)) <= set(order[24:])
    resumed = _samplers(monkeypatch, 3, state)
    resumed[0].record_batch(0, 2)  # rank 0 alone records the batch all 3 ranks trained
    assert resumed[0].processed_indices == set(order[:30])
    resumed[1].record_indices([order[40]])
    assert resumed[1].processed_indices == set(order[:24]) | {order[40]}
    (one,) = _samplers(monkeypatch, 1, state)
    one.set_epoch(1)  # a new epoch: nothing processed, another order
    assert one.processed_indices == set() and one.epoch == 1
    assert sorted(one) == list(range(48)) and list(one) != order
    plain = _samplers(monkeypatch, 2, None)[1]
    plain.shuffle = False
    plain.set_epoch(0)
    assert list(plain) == list(range(1, 48, 2))
    almost_done = {**state, "processed_indices": sorted(set(range(48)) - {order[47]})}
    last = _samplers(monkeypatch, 4, almost_done)  # one sample left for 4 ranks
    assert [list(s) for s in last] == [[order[47]]] * 4  # every rank gets a batch


def _state_checks(folder: str) -> dict[str, Any]:
    """On each of 2 ranks: sync, commit (to `folder`), restore, the gathered sampler
    progress, a resume where only rank 1 finds the commit, and a lost peer's exit."""
    from dtrain.horovod.errors import HorovodInternalError, PeerLostError

    os.environ[durable.DIR_VAR] = os.path.join(folder, "shared")
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(rank)  # the ranks start apart; sync makes them equal
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=1)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0)
    state.sync()
    synced = model.weight.detach().clone()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    sampler.record_indices([rank])  # each rank its own: a commit gathers them
    state.epoch = 2
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    state.epoch = 9
    state.restore()
    out: dict[str, Any] = {
        "synced": synced,
        "restored": torch.equal(model.weight, committed["weight"]) and state.epoch == 2,
        "gathered": state._handlers["train_sampler"].saved["processed_indices"],
    }
    hvd.barrier()  # rank 0 (local rank 0) has written the commit
    out["file"] = os.path.isfile(os.path.join(folder, "shared", f"state-{state._number}.pt"))
    hvd.barrier()
    # A restarted group where only rank 1's machine kept the commit: its copy wins.
    own = os.path.join(folder, f"rank{rank}")
    os.makedirs(own, exist_ok=True)
    if rank == 1:
        os.replace(os.path.join(folder, "shared", f"state-{state._number}.pt"),
                   os.path.join(own, f"state-{state._number}.pt"))  # fmt: skip
    hvd.barrier()
    os.environ[durable.DIR_VAR] = own
    torch.manual_seed(10 + rank)
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    restarted = hvd.elastic.TorchState(fresh, fresh_optimizer, epoch=0)
    restarted._number = state._number  # a restarted script numbers its states alike
    resets: list[int] = []
    restarted.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState, fail: bool) -> int:
        if fail:
            raise HorovodInternalError("gloo: connection closed by peer")
        return state.epoch

    out["resumed_epoch"] = train(restarted, False)
    out["resumed_weight"] = torch.equal(fresh.weight, committed["weight"])
    out["momentum"] = torch.equal(
        fresh_optimizer.state[fresh.weight]["momentum_buffer"],
        optimizer.state[model.weight]["momentum_buffer"],
    )
    out["resets"] = resets
    try:
        train(restarted, True)
    except PeerLostError as e:
        out["lost"] = str(e)
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_torch_state_commit_restore_sync_and_resume_on_two_ranks(tmp_path: Path) -> None:
    ranks = run_ranks(_state_checks, 2, str(tmp_path), timeout=100)
    assert_close(ranks[0]["synced"], ranks[1]["synced"], rtol=0, atol=0)
    for out in ranks:
        assert out["restored"]
        assert out["gathered"] == [0, 1]
        assert out["resumed_epoch"] == 2 and out["resumed_weight"] and out["momentum"]
        assert out["resets"] == [2]
        assert "lost the group (gloo: connection closed by peer)" in out["lost"]
        assert "\n" not in out["lost"]
    assert ranks[0]["file"] and ranks[1]["file"]


class _Launch:
    """Stands in for the launcher: records what horovodrun asks of it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, config: Any, target: Any, min_hosts: int | None = None) -> None:
        self.calls.append({"config": config, "min_hosts": min_hosts, "env": dict(os.environ)})


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-np", "2", "--min-np", "1", "--max-np", "2"], {"nproc": 2, "restarts": 3}),
        (["--min-np", "1", "--max-np", "2", "--reset-limit", "5"], {"nproc": 2, "restarts": 5}),
        (["-np", "2", "--timeline-filename", "t.json"], {"nproc": 2, "restarts": 0}),
        (["-H", "a:2,b:2", "--min-np", "2", "--max-np", "4"], {"hosts": 2, "min_hosts": 1}),
        (["--host-discovery-script", "echo localhost:2"], {"nproc": 2, "restarts": 3}),
        (["--host-discovery-script", "printf 'a\\nb\\n'", "--slots-per-host", "3"],
         {"hosts": 2, "min_hosts": 1}),
    ],
)  # fmt: skip
def test_horovodrun_maps_elastic_flags(
    argv: list[str], expected: dict[str, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    launch = _Launch()
    monkeypatch.setattr("dtrain.horovod.run.launch", launch)
    monkeypatch.delenv(durable.DIR_VAR, raising=False)
    assert horovodrun([*argv, "--output-filename", str(tmp_path), "python", str(EXAMPLE)]) == 0
    (call,) = launch.calls
    config, env = call["config"], call["env"]
    if "nproc" in expected:
        assert config.nproc == expected["nproc"] and config.max_restarts == expected["restarts"]
        assert call["min_hosts"] is None
    else:
        assert len(config.hosts) == expected["hosts"] and call["min_hosts"] == expected["min_hosts"]
        assert config.max_restarts == 3
    assert env["DTRAIN_HOROVOD_OUTPUT_DIR"] == str(tmp_path)
    assert ("HOROVOD_TIMELINE" in env) == ("--timeline-filename" in argv)
    folder = env[durable.DIR_VAR]
    assert "horovodrun-elastic-" in folder and not os.path.exists(folder)  # removed at the end
    assert durable.DIR_VAR not in os.environ


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "3", "--min-np", "1", "--max-np", "2"], "outside --min-np 1 .. --max-np 2"),
        (["--min-np", "3", "--max-np", "2"], "1 <= --min-np <= --max-np"),
        (["-H", "a:2,b:2", "--min-np", "3", "--max-np", "4"], "multiples of the 2 slots"),
        (["-H", "a:2,b:2,c:2", "--min-np", "2", "--max-np", "4"], "list at most 2 hosts"),
        (["--host-discovery-script", "exit 3"], "failed with exit code 3"),
        (["--host-discovery-script", "echo a:x"], "HOST:SLOTS with SLOTS a positive"),
        (["-H", "a:2", "--host-discovery-script", "echo a"], "only one of -H and --host"),
        (["--min-np", "1", "--reset-limit", "-1"], "--reset-limit must be 0 or more"),
    ],
)
def test_horovodrun_refuses_elastic_counts_that_do_not_map(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert horovodrun([*argv, "python", str(EXAMPLE)]) == 2
    assert message in capsys.readouterr().err


def _run(command: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(240)
def test_a_rank_that_dies_mid_epoch_restarts_the_group_from_the_last_commit(
    tmp_path: Path,
) -> None:
    common = ["--epochs", "2", "--lr", "0.05", "--seed", "5"]
    horovodrun_command = [
        sys.executable, "-m", "dtrain.horovod.run", "-np", "2", "--min-np", "1", "--max-np", "2",
        "--output-filename", "logs", "python", str(EXAMPLE), *common, "--batch-size", "32",
        "--crash-at", "7", "--save", "elastic.pt",
    ]  # fmt: skip
    # The reference: one process on the same global batches, uninterrupted.
    reference_command = [
        sys.executable, str(EXAMPLE), *common, "--batch-size", "64", "--lr", "0.1",
        "--save", "reference.pt",
    ]  # fmt: skip
    elastic, reference = _run(horovodrun_command, tmp_path), _run(reference_command, tmp_path)
    out, err = elastic.communicate(timeout=200)
    assert reference.wait(timeout=60) == 0, reference.communicate()[1]
    assert elastic.returncode == 0, out + err
    assert "restarting it, attempt 2 of 4" in err
    assert "hvd.elastic: resumed from commit" in err
    assert_close(torch.load(tmp_path / "elastic.pt"), torch.load(tmp_path / "reference.pt"))
    logs = tmp_path / "logs"
    assert "rank 0 of 2: training from epoch 0" in (logs / "rank.0" / "stdout").read_text()
    rank1 = (logs / "rank.1" / "stdout").read_text()
    assert "rank 1 of 2: training from epoch 0" in rank1  # the first attempt, kept
    assert "rank 1 of 2: training from epoch 1" in rank1  # the restarted one, appended
    assert "crashing at epoch 1, batch 7" in (logs / "rank.1" / "stderr").read_text()
