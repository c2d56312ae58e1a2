"""The nodes of a job, read from the scheduler that started it (Slurm, Kubeflow).

Only the `dtrain` command consults this, when it builds the topology from its flags; a
flag given on the command line (or in ``--config``) wins over the scheduler's value. The
workers dtrain starts never look here: their own RANK, WORLD_SIZE and MASTER_ADDR come from
the launcher, not from a PyTorchJob.

- **Slurm**, one task per node (``srun --ntasks-per-node=1 dtrain run ...``): the step's
  node list (``node[01-04,07]`` expanded), this node's place in it, the first node as the
  rendezvous host, and the port ``MASTER_PORT`` if set, else ``29500 + job id % 2000``, so
  that two jobs sharing a node rarely meet on one port.
- **Kubeflow Trainer** (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT``, ``PET_NPROC_PER_NODE``): torchrun's variables, as its torch runtime
  sets them.
- **Kubeflow PyTorchJob** (the older operator): ``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE`` (nodes) and ``RANK`` (this node), in a Kubernetes pod.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from dtrain.errors import ConfigError

SLURM_BASE_PORT = 29500
SLURM_PORT_SPAN = 2000
_LAUNCHED = ("DTRAIN_CONFIG", "TORCHELASTIC_RUN_ID")
"""Set in the processes a launcher started: those are workers, not a node's command."""


@dataclass(frozen=True)
class Allocation:
    """What the scheduler says about this node of the job."""

    scheduler: str
    nnodes: int
    node_rank: int
    master: str
    nproc: int | None = None


def detect(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation the scheduler's variables in `environ` (default: this process's)
    give, or None outside any scheduler we know."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _LAUNCHED):
        return None
    if "PET_NNODES" in env and "PET_MASTER_ADDR" in env:
        return _kubeflow_trainer(env)
    if "KUBERNETES_SERVICE_HOST" in env and all(
        name in env for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    ):
        return _pytorchjob(env)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
        return _slurm(env)
    return None


def _number(env: Mapping[str, str], name: str, scheduler: str) -> int:
    text = env.get(name, "")
    if not text.strip().isdigit():
        raise ConfigError(
            f"{scheduler} set {name}={text!r}, which is not a whole number, so dtrain cannot "
            "tell this node's place in the job; give --nnodes, --node-rank and --master on "
            "the command line instead."
        )
    return int(text)


def _kubeflow_trainer(env: Mapping[str, str]) -> Allocation:
    name = "Kubeflow Trainer"
    nproc = env.get("PET_NPROC_PER_NODE", "").strip()
    return Allocation(
        name,
        nnodes=_number(env, "PET_NNODES", name),
        node_rank=_number(env, "PET_NODE_RANK", name) if "PET_NODE_RANK" in env else 0,
        master=f"{env['PET_MASTER_ADDR']}:{_number(env, 'PET_MASTER_PORT', name)}",
        # "auto", "gpu" and "cpu" are torchrun's own choices: --nproc decides here.
        nproc=int(nproc) if nproc.isdigit() else None,
    )


def _pytorchjob(env: Mapping[str, str]) -> Allocation:
    name = "The PyTorchJob"
    return Allocation(
        "PyTorchJob",
        nnodes=_number(env, "WORLD_SIZE", name),
        node_rank=_number(env, "RANK", name),
        master=f"{env['MASTER_ADDR']}:{_number(env, 'MASTER_PORT', name)}",
    )


def _slurm(env: Mapping[str, str]) -> Allocation:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    nodes = expand_nodelist(nodelist)
    if not nodes:
        raise ConfigError(
            "Slurm set no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST), so dtrain "
            "cannot find the first node; give --nnodes, --node-rank and --master instead."
        )
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or len(nodes))
    if tasks != len(nodes):
        raise ConfigError(
            f"srun started {tasks} tasks on {len(nodes)} node(s), but dtrain starts the "
            "processes of a node itself (--nproc): run one task per node, "
            "`srun --ntasks-per-node=1 dtrain run ...`."
        )
    here = env.get("SLURMD_NODENAME")
    node_rank = nodes.index(here) if here in nodes else _number(env, "SLURM_NODEID", "Slurm")
    port = env.get("MASTER_PORT") or str(slurm_port(_number(env, "SLURM_JOB_ID", "Slurm")))
    return Allocation("Slurm", nnodes=len(nodes), node_rank=node_rank, master=f"{nodes[0]}:{port}")


def slurm_port(job_id: int) -> int:
    """The rendezvous port of Slurm job `job_id`: 29500 + job id % 2000 (below Linux's
    ephemeral ports, which start at 32768)."""
    return SLURM_BASE_PORT + job_id % SLURM_PORT_SPAN


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compact host list as names: ``node[01-03,07],gpu5`` gives node01, node02,
    node03, node07, gpu5 (zero padding kept), read by python-hostlist as Slurm writes it."""
    try:
        names = hostlist.expand_hostlist(text.strip())
    except hostlist.BadHostlist:
        raise _bad_nodelist(text) from None
    return [name for name in names if name]


def _bad_nodelist(text: str) -> ConfigError:
    return ConfigError(
        f"Slurm's node list {text!r} is not in a form dtrain reads (names such as "
        "node[01-04,07],gpu5); give --nnodes, --node-rank and --master on the command line."
    )
