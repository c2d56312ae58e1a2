"""The nodes of a job from Slurm's and Kubeflow's variables (monkeypatched environment);
command-line flags win, and without a scheduler nothing changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.cli import build_parser
from dtrain.config import Config
from dtrain.config.file import parse_with_config
from dtrain.errors import ConfigError
from dtrain.launcher.schedulers import Allocation, detect, expand_nodelist, slurm_port
from dtrain.launcher.topology_flags import config_from

SCHEDULER_VARIABLES = ("SLURM_", "PET_", "KUBERNETES_", "TORCHELASTIC_")

SRUN_NODE2 = {
    "SLURM_JOB_ID": "4321",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_NTASKS": "2",
}


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith(SCHEDULER_VARIABLES) or name in ("MASTER_PORT", "SLURMD_NODENAME"):
            monkeypatch.delenv(name)


def config_of(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *flags: str) -> Config:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return config_from(build_parser().parse_args(["run", *flags, "train.py"]))


@pytest.mark.parametrize(
    "text, names",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu[9-11]-ib,login", ["gpu9-ib", "gpu10-ib", "gpu11-ib", "login"]),
        ("solo", ["solo"]),
        ("x[1-2]y[7]", ["x1y7", "x2y7"]),
    ],
)
def test_slurm_node_lists_expand(text: str, names: list[str]) -> None:
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text", ["node[a-b]", "node[1-2", "node[3-1]"])
def test_a_node_list_dtrain_cannot_read_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="not in a form dtrain reads"):
        expand_nodelist(text)


def test_srun_gives_the_step_nodes_and_a_port_from_the_job_id() -> None:
    assert slurm_port(4321) == 29500 + 321 and slurm_port(12000) == 29500
    assert detect(SRUN_NODE2) == Allocation("Slurm", 2, 1, f"gpu07:{29500 + 321}")
    assert detect({**SRUN_NODE2, "MASTER_PORT": "6000"}).master == "gpu07:6000"  # type: ignore[union-attr]
    batch_script = {k: v for k, v in SRUN_NODE2.items() if k != "SLURM_STEP_ID"}
    assert detect(batch_script) is None  # only srun's tasks are nodes of the job
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1"):
        detect({**SRUN_NODE2, "SLURM_NTASKS": "8"})


def test_kubeflow_trainer_and_pytorchjob_variables() -> None:
    trainer = {
        "PET_NNODES": "4",
        "PET_NODE_RANK": "3",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
        "PET_NPROC_PER_NODE": "2",
    }
    assert detect(trainer) == Allocation("Kubeflow Trainer", 4, 3, "job-node-0-0.job:29400", 2)
    assert detect({**trainer, "PET_NPROC_PER_NODE": "auto"}).nproc is None  # type: ignore[union-attr]
    job = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"}
    assert detect({**job, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == Allocation(
        "PyTorchJob", 2, 1, "job-master-0:23456"
    )
    assert detect(job) is None  # torchrun's variables on a laptop are no PyTorchJob
    with pytest.raises(ConfigError, match="PET_NNODES='2:4', which is not a whole number"):
        detect({**trainer, "PET_NNODES": "2:4"})


def test_the_workers_dtrain_starts_never_read_a_scheduler() -> None:
    worker = {**SRUN_NODE2, "RANK": "3", "WORLD_SIZE": "4", "KUBERNETES_SERVICE_HOST": "x"}
    assert detect({**worker, "DTRAIN_CONFIG": "{}"}) is None
    assert detect({**worker, "TORCHELASTIC_RUN_ID": "r"}) is None


def test_the_command_takes_the_scheduler_s_nodes_and_its_flags_win(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_of(monkeypatch, SRUN_NODE2, "--nproc", "2")
    assert (config.nnodes, config.node_rank, config.master, config.nproc) == (
        2, 1, "gpu07:29821", 2
    )  # fmt: skip
    assert "Slurm runs this job on 2 nodes; this is node 1" in capsys.readouterr().err
    flags = ("--nnodes", "3", "--node-rank", "2", "--master", "head:1234")
    config = config_of(monkeypatch, SRUN_NODE2, *flags)
    assert (config.nnodes, config.node_rank, config.master) == (3, 2, "head:1234")
    assert "Slurm" not in capsys.readouterr().err
    one_node = {**SRUN_NODE2, "SLURM_STEP_NODELIST": "gpu07", "SLURMD_NODENAME": "gpu07"}
    one_node["SLURM_NTASKS"] = "1"
    assert config_of(monkeypatch, one_node).master is None  # one node: a local port


def test_without_a_scheduler_the_command_behaves_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    laptop = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    config = config_of(monkeypatch, laptop)
    assert config == Config()
    assert config_of(monkeypatch, laptop, "--nproc", "2") == Config(nproc=2)


def test_nnodes_takes_a_count_or_an_elastic_range(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert config_of(monkeypatch, {}, "--nnodes", "2", "--master", "h:1").min_nnodes is None
    elastic = config_of(monkeypatch, {}, "--nnodes", "1:3", "--master", "h:1")
    assert (elastic.min_nnodes, elastic.nnodes) == (1, 3)
    with pytest.raises(ConfigError, match="--nnodes MIN:MAX needs 1 <= MIN <= MAX, got 3:2"):
        config_of(monkeypatch, {}, "--nnodes", "3:2", "--master", "h:1")
    with pytest.raises(ConfigError, match="drop --node-rank"):
        config_of(monkeypatch, {}, "--nnodes", "1:3", "--node-rank", "1", "--master", "h:1")
    toml = tmp_path / "job.toml"
    toml.write_text('nnodes = 2\nmaster = "h:1"\n')
    args = parse_with_config(build_parser(), ["run", "--config", str(toml), "train.py"])
    assert config_from(args).nnodes == 2
