"""Jobs across test hosts (network namespaces, tests/cluster.py): every node runs the same
`dtrain run` command with its own --node-rank and the same --master dt-h1:PORT, and the
parameters after a few steps of the equivalence job (tests/training.py) equal one
process's; an unreachable rendezvous is named within --timeout."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cluster
import pytest
import safetensors.torch
import torch
from sshd import ssh_environment, start_sshd, why_no_sshd
from torch.testing import assert_close
from training import train

WHY_NOT = cluster.unavailable()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no test hosts: {WHY_NOT}"),
    pytest.mark.timeout(180),
]

STEPS = 6
JOB = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import safetensors.torch
from training import train_variants

variants = [dict(steps={STEPS}, **options) for options in json.loads(sys.argv[2])]
for i, params in enumerate(train_variants(variants)):
    if params is not None:
        safetensors.torch.save_file(params, f"{{sys.argv[1]}}.{{i}}")
"""
_ports = itertools.count(29400)


@pytest.fixture(scope="module")
def hosts() -> Iterator[cluster.Cluster]:
    """Two test hosts, dt-h1 and dt-h2, on links shaped to 1 Gbit/s."""
    with cluster.cluster(2, rate="1gbit") as made:
        yield made


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain.cli", *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def run_nodes(
    hosts: cluster.Cluster,
    tmp_path: Path,
    *flags: str,
    variants: tuple[dict, ...] = ({},),
    elastic: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Run the job with `dtrain run FLAGS` on both hosts, as node 0 (dt-h1) and node 1
    (with `elastic`, as `--nnodes 1:2`: the rendezvous numbers them), once per variant
    (options that override the flags' in `dtrain.init`), one after the other in the same
    processes; return the final parameters of each."""
    master = f"dt-h1:{next(_ports)}"
    script, result = tmp_path / "job.py", tmp_path / "params.safetensors"
    script.write_text(JOB)
    job = [str(script), str(result), json.dumps(variants)]
    nodes = ["--nnodes", "1:2" if elastic else "2", "--master", master, "--timeout", "60"]
    procs = [
        hosts.popen(
            host,
            _command("run", *flags, *nodes, *([] if elastic else ["--node-rank", str(rank)]), *job),
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank, host in enumerate(hosts.hosts)
    ]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    return [safetensors.torch.load_file(f"{result}.{i}") for i in range(len(variants))]


@pytest.fixture(scope="module")
def single() -> dict[str, torch.Tensor]:
    """The same job in this process, alone: the reference every layout must equal."""
    return train(steps=STEPS, strategy="single")


TWO_BY_TWO = {
    "hierarchical": {},
    "flat": {"hierarchical": False},
    # Local SGD syncing after every step of SGD trains ddp's model.
    "local-sgd": {"strategy": "local-sgd", "sync_every": 1, "hierarchical": False},
    "hsdp": {"strategy": "hsdp", "shard_size": 2, "hierarchical": False},
}
"""The layouts run on two hosts of two processes, in one job, by name: ddp as the flags
start it (--hierarchical), and the variants' options over them."""


@pytest.fixture(scope="module")
def two_by_two(
    hosts: cluster.Cluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, torch.Tensor]]:
    """The parameters of each of `TWO_BY_TWO`, by name."""
    flags = ("--strategy", "ddp", "--nproc", "2", "--hierarchical")
    tmp_path = tmp_path_factory.mktemp("two-by-two")
    found = run_nodes(hosts, tmp_path, *flags, variants=tuple(TWO_BY_TWO.values()))
    return dict(zip(TWO_BY_TWO, found, strict=True))


def test_ddp_on_two_hosts_equals_one_process(
    two_by_two: dict[str, dict[str, torch.Tensor]], single: dict[str, torch.Tensor]
) -> None:
    """ddp over both hosts' processes alike, and local SGD syncing after every step."""
    assert_close(two_by_two["flat"], single)
    assert_close(two_by_two["local-sgd"], single)


def test_diloco_trains_the_digits_across_two_hosts(hosts: cluster.Cluster, tmp_path: Path) -> None:
    """DiLoCo (Nesterov outer steps every 8 inner AdamW steps) over the 1 Gbit/s link."""
    master = f"dt-h1:{next(_ports)}"
    flags = (
        "--strategy", "local-sgd", "--sync-every", "8", "--outer-optimizer", "nesterov",
        "--outer-lr", "0.7", "--optimizer", "adamw", "--lr", "0.003", "--nnodes", "2",
        "--master", master, "--timeout", "60",
    )  # fmt: skip
    procs = [
        hosts.popen(
            host,
            _command(
                "demo",
                *flags,
                "--node-rank",
                str(rank),
                "--out",
                str(tmp_path / f"n{rank}"),
                "--metrics-json",
                str(tmp_path / f"m{rank}.json"),
            ),  # fmt: skip
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank, host in enumerate(hosts.hosts)
    ]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    metrics = json.loads((tmp_path / "m0.json").read_text())
    assert metrics["strategy"] == "local-sgd" and metrics["world_size"] == 2
    assert (metrics["sync_every"], metrics["syncs"]) == (8, 264 // 8)  # 264 steps in all
    # DiLoCo's inner optimizer is AdamW: the demo's SGD with momentum 0.9 under an outer
    # momentum of 0.9 overshoots (about 83%).
    assert metrics["test_accuracy"] >= 0.95, metrics


def test_elastic_nodes_meet_at_the_master_and_train_as_one_process(
    hosts: cluster.Cluster, single: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """--nnodes 1:2 (torch's c10d rendezvous hosted at --master): both hosts join within
    the last call, and the two workers train as one process."""
    assert_close(run_nodes(hosts, tmp_path, "--strategy", "ddp", elastic=True)[0], single)


def test_hierarchical_ddp_and_hsdp_on_two_hosts_of_two_equal_one_process(
    two_by_two: dict[str, dict[str, torch.Tensor]], single: dict[str, torch.Tensor]
) -> None:
    """--hierarchical averages inside each host, then across; hsdp shards inside each
    host (--shard-size 2) and replicates across."""
    assert_close(two_by_two["hierarchical"], single)
    assert_close(two_by_two["hsdp"], single)


def test_an_unreachable_rendezvous_is_named_within_the_timeout(
    hosts: cluster.Cluster, tmp_path: Path
) -> None:
    """Node 1 alone: nobody listens at dt-h1's port; and an address on the test network
    that no host holds (no route to it)."""
    port = next(_ports)
    cases = {
        "refused": (hosts.hosts[1], "dt-h1", "dt-h1 (10.77.0.1)"),
        "nobody": (hosts.hosts[0], "10.77.0.9", "10.77.0.9"),
    }
    started = time.monotonic()
    procs = {
        case: hosts.popen(
            host,
            _command(
                "demo",
                "--model",
                "mlp",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--timeout",
                "3",
                "--master",
                f"{master}:{port}",
                "--out",
                str(tmp_path / case),
            ),
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for case, (host, master, _) in cases.items()
    }
    outputs = {case: p.communicate(timeout=60)[0] for case, p in procs.items()}
    elapsed = time.monotonic() - started
    for case, (_, _, where) in cases.items():
        assert procs[case].returncode == 1, outputs[case][-2000:]
        expected = f"Node 1 could not reach the rendezvous at {where} port {port} within 3 s"
        assert expected in outputs[case], outputs[case][-2000:]
        assert "Traceback" not in outputs[case]
    assert elapsed < 3 + 25  # the timeout, plus starting Python and torch on a busy machine


def test_one_command_over_ssh_starts_both_hosts_and_equals_one_process(
    hosts: cluster.Cluster, single: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """`dtrain run -H dt-h1:1,dt-h2:1` on dt-h1 logs in to both hosts (an sshd in each
    namespace), trains as one process, and leaves nothing running on either host; so does
    `horovodrun -H` with a Horovod script, and `dtrain bench --hosts` runs its trial on
    both."""
    if why_no_sshd():
        pytest.skip(why_no_sshd())
    daemons = [
        start_sshd(tmp_path / "sshd", host.address, 22, netns=host.netns) for host in hosts.hosts
    ]
    key = str(daemons[0].identity)

    def on_first_host(command: list[str]) -> str:
        """Run `command` on dt-h1 with ssh set up; its output, once it succeeded."""
        proc = hosts.popen(
            hosts.hosts[0],
            command,
            cwd=tmp_path,
            env={**_env(), **ssh_environment(daemons[0])},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        output = proc.communicate(timeout=150)[0]
        assert proc.returncode == 0, output[-3000:]
        return output

    try:
        script, result = tmp_path / "job.py", tmp_path / "params.safetensors"
        script.write_text(JOB)
        output = on_first_host(
            _command("run", "-H", "dt-h1:1,dt-h2:1", "--ssh-identity", key, "--strategy", "ddp",
                     "--timeout", "60", str(script), str(result), json.dumps([{}]))
        )  # fmt: skip
        assert "[dt-h1] [rank 0]" in output
        assert_close(safetensors.torch.load_file(f"{result}.0"), single)
        example = Path(__file__).parents[1] / "examples" / "horovod_synthetic_benchmark.py"
        output = on_first_host(
            [sys.executable, "-m", "dtrain.horovod.run", "-np", "2", "-H", "dt-h1:1,dt-h2:1",
             "-i", key, "python", str(example), "--num-iters", "1", "--hidden", "64"]
        )  # fmt: skip
        assert "Total samples/sec on 2 process(es)" in output
        on_first_host(
            _command("bench", "--strategies", "ddp", "--nproc", "1", "--hosts", "dt-h1,dt-h2",
                     "--ssh-identity", key, "--repeats", "1", "--steps", "5", "--out",
                     str(tmp_path / "bench"))
        )  # fmt: skip
        (row,) = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
        assert (row["processes"], row["status"]) == (2, "ok"), row
        daemon_pids = {str(d.process.pid) for d in daemons}
        for host in hosts.hosts:
            pids = subprocess.run(
                ["ip", "netns", "pids", host.netns], capture_output=True, text=True
            )
            left = [p for p in pids.stdout.split() if p not in daemon_pids]
            assert not left or _only_sshd(left), f"{host.name}: {left}"
    finally:
        for daemon in daemons:
            daemon.stop()


def _only_sshd(pids: list[str]) -> bool:
    """True if every process left is the test's sshd (its forked listener included)."""
    names = [
        Path(f"/proc/{p}/comm").read_text().strip() for p in pids if Path(f"/proc/{p}").exists()
    ]
    return all(name == "sshd" for name in names)
