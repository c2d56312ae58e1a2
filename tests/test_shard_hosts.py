"""Issue 27 done: a corpus stored as shard files in 2 partitions trains under every
data-parallel strategy as one process does, across two test hosts that each hold only their
own partition's files, and resumes exactly at another world size after a worker is killed.

Every job trains a float64 MLP on the same shard files with the same global batch, so its
parameters must equal one process's after the same steps."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import cluster
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from conftest import run_cli
from distributed import run_ranks
from test_ps import SERVER, ps_rank
from torch import nn
from torch.testing import assert_close
from training import finish

import dtrain
from dtrain.checkpoint import read_manifest, step_path
from dtrain.data.shard_files import INDEX, ShardFiles
from dtrain.data.shard_write import write_shards

SIZE = 48  # 2 partitions of 24: 4 steps an epoch at a global batch of 12
GLOBAL_BATCH = 12
STEPS = 7  # into epoch 1
KILLED_AT = 6  # mid-epoch 1: the resumed run skips 2 of its global batches
STRATEGIES: tuple[dict[str, Any], ...] = (
    {"strategy": "ddp"},
    {"strategy": "zero1"},
    {"strategy": "zero2"},
    {"strategy": "zero3"},
    {"strategy": "hsdp", "shard_size": 2},
    # Averaging every step under SGD with momentum (linear in the gradient) is ddp.
    {"strategy": "local-sgd", "sync_every": 1},
)
PS = {"nproc": 2, "servers": 1}
"""Synchronous ps's options: 2 workers (the data-parallel ranks) and a server."""

JOB = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import safetensors.torch
from test_shard_hosts import train

directory, root, kill_at, out = sys.argv[1:]
params = train(directory, root=root or None, kill_at=int(kill_at))
if params is not None:
    safetensors.torch.save_file(params, out)
"""
"""`train` under `dtrain run`: JOB DIRECTORY ROOT KILL_AT OUT (ROOT '' for no checkpoints)."""


def train(
    directory: str,
    steps: int = STEPS,
    root: str | None = None,
    kill_at: int = 0,
    close: bool = True,
    **options: Any,
) -> dict[str, torch.Tensor] | None:
    """Train a float64 MLP with SGD and momentum on the shard files in `directory` to step
    `steps` under `options` (given to dtrain.init; a launcher's flags without them). With
    `root`, resume from its newest checkpoint and save one there after every step. Rank 1
    SIGKILLs itself after step `kill_at` (and its checkpoint), as a worker lost mid-run.
    The parameters (main rank)."""
    engine = dtrain.init(seed=0, **options)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = engine.setup(model, optimizer)
    if root is not None:
        engine.resume(root)
    loader = engine.dataloader(ShardFiles(directory), global_batch_size=GLOBAL_BATCH)
    epoch = engine.epoch
    while engine.step < steps:
        for batch in engine.progress(loader, epoch):
            engine.train_step(batch, F.cross_entropy)
            if root is not None:
                engine.save(step_path(root, engine.step))
            if engine.step == kill_at and engine.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.step == steps:
                break
        epoch += 1
    del model, optimizer
    return finish(engine, close)


def every_strategy(directory: str) -> list[dict[str, torch.Tensor] | None]:
    """`train` under each of STRATEGIES, one after the other in this process group."""
    last = len(STRATEGIES) - 1
    return [train(directory, close=i == last, **options) for i, options in enumerate(STRATEGIES)]


def ps_job(directory: str) -> Any:
    """`train` under PS on a worker; a server serves."""
    return ps_rank(functools.partial(train, directory, strategy="ps", **PS), PS)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus: 48 float64 samples of 6 features and a class, in shards of 5 written in
    2 partitions."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SIZE, 6, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (SIZE,), generator=generator)
    samples = list(zip(inputs, targets, strict=True))
    return write_shards(samples, tmp_path_factory.mktemp("corpus") / "shards", 5, partitions=2)


@pytest.fixture(scope="module")
def single(shards: Path) -> dict[str, torch.Tensor] | None:
    """One process, all the files: what every job must train."""
    return train(str(shards), strategy="single")


@pytest.mark.timeout(300)
def test_every_data_parallel_strategy_trains_shard_files_as_one_process(
    shards: Path, single: dict[str, torch.Tensor]
) -> None:
    results = run_ranks(every_strategy, 2, str(shards), timeout=180)[0]
    for options, params in zip(STRATEGIES, results, strict=True):
        assert_close(params, single, msg=lambda m, o=options: f"{o}: {m}")
    workers = run_ranks(ps_job, 3, str(shards), timeout=90)
    assert workers[2] == SERVER
    assert_close(workers[0], single)


def job_args(*flags: str, directory: Path, root: str, kill_at: int, out: Path) -> list[str]:
    """The arguments of `dtrain run FLAGS` of JOB (written beside `out`)."""
    script = out.with_suffix(".py")
    script.write_text(JOB)
    job = [str(script), str(directory), root, str(kill_at), str(out)]
    return ["run", *flags, "--timeout", "60", *job]


@pytest.mark.timeout(300)
def test_killed_at_two_processes_resumes_at_one_as_if_uninterrupted(
    shards: Path, single: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    root, out = tmp_path / "checkpoints", tmp_path / "params.safetensors"
    for nproc, kill_at in (("2", KILLED_AT), ("1", 0)):
        args = job_args("--strategy", "ddp", "--nproc", nproc, directory=shards, root=str(root),
                        kill_at=kill_at, out=out)  # fmt: skip
        run = run_cli(*args, cwd=tmp_path, timeout=140)
        if kill_at:  # the lost worker ended the job after its last checkpoint
            assert re.search(r"Rank 1 \(.*\) was killed by signal SIGKILL", run.stderr), run.stderr
            assert run.returncode != 0 and not out.exists()
            assert max(p.name for p in root.iterdir()) == step_path(root, KILLED_AT).name
    assert run.returncode == 0, run.stderr[-3000:]
    written = [read_manifest(step_path(root, step))["world_size"] for step in range(1, STEPS + 1)]
    assert written == [2] * KILLED_AT + [1] * (STEPS - KILLED_AT)  # resumed, not restarted
    assert_close(safetensors.torch.load_file(out), single)


WHY_NO_HOSTS = cluster.unavailable()


@pytest.mark.skipif(WHY_NO_HOSTS is not None, reason=f"no test hosts: {WHY_NO_HOSTS}")
@pytest.mark.timeout(240)
def test_two_hosts_each_holding_only_its_partition_train_as_one_process(
    shards: Path, single: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Node p (dt-h{p+1}, one process) sees at the path --data names only index.json and
    partition p's files: a bind mount over that path inside its host (`ip netns exec` runs
    each command in a mount namespace of its own, so the mount is that host's alone and
    ends with it)."""
    files = ShardFiles(shards)
    mounted = tmp_path / "shards"  # the same path on both hosts, empty on this machine
    mounted.mkdir()
    views = []
    for partition in (0, 1):
        view = tmp_path / f"host{partition + 1}"
        view.mkdir()
        for name in [INDEX, *(files.names[k] for k in files.of_partition[partition])]:
            shutil.copy(shards / name, view)
        views.append(view)
    held = [{p.name for p in view.iterdir()} for view in views]
    assert held[0] & held[1] == {INDEX} and len(held[0]) + len(held[1]) == len(files.names) + 2
    out = tmp_path / "params.safetensors"
    nodes = ("--nnodes", "2", "--master", "dt-h1:29517", "--strategy", "ddp")
    # In each host: its view mounted over the shared path, then the node's command.
    mount = 'mount --bind "$0" "$1" && shift && exec "$@"'
    with cluster.cluster(2) as hosts:
        procs = []
        for rank, (host, view) in enumerate(zip(hosts.hosts, views, strict=True)):
            args = job_args(*nodes, "--node-rank", str(rank), directory=mounted, root="",
                            kill_at=0, out=out)  # fmt: skip
            procs.append(
                hosts.popen(
                    host,
                    ["sh", "-c", mount, str(view), str(mounted), *cluster.dtrain_command(*args)],
                    cwd=tmp_path,
                    env=cluster.job_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    assert not any(mounted.iterdir())  # the hosts' views never reached this machine
    assert_close(safetensors.torch.load_file(out), single)
