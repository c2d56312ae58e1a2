"""Launch the workers of a job.

A one-process job on one machine runs in this process (like ``python script.py``); any
other job goes through `torch.distributed.launcher.api.elastic_launch`, the agent behind
torchrun: it starts the workers, sets RANK/WORLD_SIZE/LOCAL_RANK and the rendezvous,
watches them, restarts the group up to --max-restarts times, and stops every survivor
when one fails. We turn its failure record into a message naming each failed rank, its
exit code or signal, and its own traceback.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtrain import advice
from dtrain.config import ENV_VAR, Config
from dtrain.errors import OFFLOAD_NEEDS_GPUS, ConfigError, DtrainError, LaunchError, Stopped
from dtrain.launcher import addressing, bootstrap
from dtrain.launcher.failures import (
    exit_code_of,
    format_failures,
    rendezvous_failed,
    rendezvous_host_lost,
)
from dtrain.launcher.hosts import as_nodes, hosts_of
from dtrain.launcher.lifeline import LAUNCHER_PID, scratch_folder
from dtrain.launcher.machines import PROBE_S, gathering, roster_of
from dtrain.launcher.remote import RANK_PREFIX_VAR
from dtrain.launcher.ssh import launch_over_ssh
from dtrain.launcher.stacks import (
    STACKS_VAR,
    read_finished,
    read_stacks,
    stopped_workers_continued,
)
from dtrain.launcher.watch import rendezvous_host_watched
from dtrain.process.topology import mask_devices, use_gpus
from dtrain.strategies.specs import lookup


@dataclass(frozen=True)
class Target:
    """What each worker runs: a script path or a module name, with its arguments."""

    kind: str
    name: str
    args: tuple[str, ...] = ()

    def check(self) -> None:
        """Fail early, before any process starts, if the target cannot exist."""
        if self.kind == "script" and not Path(self.name).is_file():
            raise ConfigError(
                f"The script {self.name} does not exist; check the path (it is relative to "
                f"{Path.cwd()})."
            )


def check_devices(config: Config) -> None:
    """With GPUs in use, one process per GPU: --nproc may not exceed the visible GPUs;
    without them, options that need GPUs are refused before any process starts."""
    if not use_gpus(config) and config.cpu_offload:
        raise ConfigError(OFFLOAD_NEEDS_GPUS)
    if lookup(config.strategy).multiprocess and use_gpus(config):
        visible = torch.cuda.device_count()
        if config.nproc > visible:
            raise ConfigError(
                f"--nproc {config.nproc} asks for more processes than the {visible} visible "
                "GPU(s); use --nproc at most the number of GPUs (see --devices), or pass --cpu "
                "to run on the CPU."
            )


def launch(config: Config, target: Target, min_hosts: int | None = None) -> None:
    """Run `target` under `config`; raise LaunchError naming the ranks that failed.

    With -H/--hostfile, this machine starts every host over ssh instead (each of them
    then comes back here with its node rank); `min_hosts` makes them an elastic job of
    at least that many hosts (horovodrun --min-np)."""
    hosts = hosts_of(config)
    if hosts is not None:
        lookup(config.strategy).check_launch(as_nodes(config, hosts).replace(min_nnodes=min_hosts))
        target.check()
        launch_over_ssh(config, target, hosts, min_hosts)
        return
    spec = lookup(config.strategy)
    spec.check_launch(config)
    spec.check_options(config)
    target.check()
    mask_devices(config.devices)
    check_devices(config)
    os.environ[ENV_VAR] = config.to_json()
    nproc = spec.processes_per_node(config)
    if nproc == 1 and config.nnodes == 1 and config.max_restarts == 0:
        _run_here(target)
    else:
        _run_elastic(config, target, nproc)


def _run_here(target: Target) -> None:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    # torchrun's variables, as for any world size: scripts that call
    # init_process_group() themselves find their rendezvous.
    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        os.environ.setdefault(name, value)
    try:
        bootstrap.run_target(target.kind, target.name, list(target.args))
    except SystemExit as e:
        if e.code not in (0, None):
            raise LaunchError(
                f"Rank 0 exited with code {e.code}.",
                exit_code=int(e.code) if isinstance(e.code, int) else 1,
            ) from None
    except DtrainError:
        raise
    except Exception as e:
        _, stack = bootstrap.describe(e)
        raise LaunchError(f"Rank 0 failed:\n{stack.rstrip()}") from None
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path


def _threads_per_worker(nproc: int) -> str:
    return str(max(1, (os.cpu_count() or 1) // nproc))


KEEP_ALIVE_ATTEMPTS = 3
"""Elastic jobs: heartbeats a machine may miss before the rendezvous counts it as gone."""


def keep_alive_interval(config: Config) -> int:
    """Seconds between a machine's heartbeats to the elastic rendezvous (whole seconds,
    as torch takes them): torch's 5 s for long timeouts, at most a twelfth of --timeout
    for short ones (so a dead machine is dropped within a quarter of it), 1 s at least."""
    return max(1, min(5, int(config.timeout_s / (4 * KEEP_ALIVE_ATTEMPTS))))


def join_timeout(config: Config) -> int:
    """Seconds a machine waits at the elastic rendezvous for MIN machines: --timeout of
    waiting proper, plus what every round spends anyway. After a machine is lost the
    survivors cannot meet until its heartbeats have run out, and then they wait out the
    last call; on a busy machine that alone could eat a short --timeout."""
    grace = keep_alive_interval(config) * KEEP_ALIVE_ATTEMPTS
    return math.ceil(config.timeout_s) + grace + config.last_call_s


def _rendezvous(config: Config) -> dict[str, object]:
    if config.nnodes == 1:
        return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "run_id": uuid.uuid4().hex}
    assert config.master is not None
    host, port = addressing.split_master(config.master)
    if config.min_nnodes is None:
        where = addressing.locate(config, wait=config.node_rank != 0)
        hosting = config.node_rank == 0
    else:
        hosting = _hosts_elastic_rendezvous(config)
        where = addressing.locate(config, wait=hosting is False)
    addressing.check_node0_hosts(config, where)
    addressing.use_interface(addressing.choose_interface(config, where))
    addressing.check_offered(config, where)
    run_id = f"dtrain-{host}-{port}"
    if config.min_nnodes is None:
        if hosting:
            addressing.check_port_free(port)
        return {
            "rdzv_backend": "static",
            "rdzv_endpoint": where.endpoint,
            "rdzv_configs": {"rank": config.node_rank, "timeout": int(config.timeout_s)},
            "run_id": run_id,
        }
    # torch's c10d rendezvous guesses which machine hosts its store from the hostname,
    # and tells the workers rank 0's hostname as MASTER_ADDR; on clusters where hostnames
    # resolve to loopback both guesses are wrong, so both are said outright.
    # Every wait of the rendezvous follows --timeout: joining, a store read (a dead
    # rendezvous host is noticed then, not after torch's 60 s), and a dead machine's
    # heartbeats running out (see keep_alive_interval).
    rdzv_configs: dict[str, object] = {
        "join_timeout": join_timeout(config),
        "last_call_timeout": config.last_call_s,
        "read_timeout": max(1, int(config.timeout_s)),
        "keep_alive_interval": keep_alive_interval(config),
        "keep_alive_max_attempt": KEEP_ALIVE_ATTEMPTS,
    }
    if hosting is not None:
        rdzv_configs["is_host"] = hosting
    return {
        "rdzv_backend": "c10d",
        "rdzv_endpoint": where.endpoint,
        "rdzv_configs": rdzv_configs,
        "run_id": run_id,
        "local_addr": addressing.source_address(where.address),
    }


def _hosts_elastic_rendezvous(config: Config) -> bool | None:
    """Whether this machine hosts the elastic rendezvous: it holds the --master address
    and nobody listens on its port yet (else another node on this machine does). None
    for a loopback --master: torch tells the nodes of one machine apart itself."""
    assert config.master is not None
    host, port = addressing.split_master(config.master)
    try:
        address = addressing.resolve(host)
    except OSError:
        return False  # locate() retries the lookup and names the host if it never resolves
    if addressing.is_loopback(address):
        return None
    if not addressing.is_local(address):
        return False
    try:
        addressing.check_port_free(port)
    except ConfigError:
        return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on right now, on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _announce_restarts(record: logging.LogRecord) -> bool:
    """Say, in one line, that the group restarts (the agent's own record is dropped):
    after a failure (4 arguments), or to take in machines waiting to join (3)."""
    if "will restart worker group" not in str(record.msg):
        return False
    args = record.args if isinstance(record.args, tuple) else ()
    if len(args) == 4:
        _, state, left, most = args
        attempt = int(most) - int(left) + 2
        print(
            f"dtrain: the worker group {str(state).lower()} (a worker failed); restarting it, "
            f"attempt {attempt} of {int(most) + 1}. {advice.after_restart()}",
            file=sys.stderr,
            flush=True,
        )
    elif len(args) == 3:
        print(
            f"dtrain: {args[1]} machine(s) waiting to join; restarting the worker group to "
            "take them in (this does not count against --max-restarts).",
            file=sys.stderr,
            flush=True,
        )
    return False


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs each failure itself; dtrain reports them once, more clearly, and
    announces restarts in its own words."""
    agent_log = logging.getLogger("torch.distributed.elastic")
    restarts = logging.getLogger("torch.distributed.elastic.agent.server.api")
    levels = agent_log.level, restarts.level
    agent_log.setLevel(logging.CRITICAL)
    restarts.setLevel(logging.INFO)
    restarts.addFilter(_announce_restarts)
    try:
        yield
    finally:
        restarts.removeFilter(_announce_restarts)
        agent_log.setLevel(levels[0])
        restarts.setLevel(levels[1])


def _host_watched(
    config: Config, rendezvous: dict[str, object]
) -> contextlib.AbstractContextManager[None]:
    """Elastic jobs, on a machine that does not host the rendezvous: stop within --timeout
    once its host is unreachable (see `watch`)."""
    rdzv_configs = rendezvous.get("rdzv_configs")
    if not isinstance(rdzv_configs, dict) or rdzv_configs.get("is_host") is not False:
        return contextlib.nullcontext()
    seconds = f"{config.timeout_s:g} s"
    return rendezvous_host_watched(
        str(rendezvous["rdzv_endpoint"]),
        config.timeout_s,
        lambda: rendezvous_host_lost(config, f"no connection to it for {seconds}"),
    )


JOB_TOKEN = "DTRAIN_JOB_TOKEN"
"""Environment variable: a token unique to one launch of a job on this machine, the same
for its restarted workers."""


def _run_elastic(config: Config, target: Target, nproc: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", _threads_per_worker(nproc))
    os.environ[LAUNCHER_PID] = str(os.getpid())
    # One job of this launcher, every restart included (the elastic run id is reused by
    # a later job on the same --master port): keys what a job leaves for its restarts.
    os.environ[JOB_TOKEN] = uuid.uuid4().hex
    if config.min_nnodes is not None:
        # torch's agents share one store server with their workers by default, set up
        # once: a machine that joins a later round (one coming back) then waits for an
        # address that the group's rank 0 never publishes again, and the round never
        # starts. Without the sharing, every round publishes a fresh one.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log_dir = scratch_folder()
    stacks = log_dir / "stacks"
    stacks.mkdir()
    os.environ[STACKS_VAR] = str(stacks)
    prefixed = os.environ.get(RANK_PREFIX_VAR) == "1"  # a host started over ssh
    rendezvous = _rendezvous(config)
    roster = roster_of(config, str(rendezvous["rdzv_endpoint"]))
    launch_config = LaunchConfig(
        min_nodes=config.min_nnodes or config.nnodes,
        max_nodes=config.nnodes,
        nproc_per_node=nproc,
        max_restarts=config.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL if prefixed else Std.NONE),
        log_line_prefix_template="[rank ${rank}] " if prefixed else None,
        **rendezvous,  # type: ignore[arg-type]
    )
    command = ("-u", "-m", bootstrap.__name__, target.kind, target.name, *target.args)
    try:
        with (
            _quiet_agent(),
            _host_watched(config, rendezvous),
            bootstrap.damaged_reports_ignored(),
            stopped_workers_continued(),
            gathering(roster) if roster is not None else contextlib.nullcontext(),
        ):
            elastic_launch(launch_config, sys.executable)(*command)
    except SignalException as e:
        raise Stopped(e.sigval) from None
    except (DistStoreError, DistNetworkError, RendezvousError) as e:
        raise LaunchError(rendezvous_failed(config, e)) from None
    except ChildFailedError as e:
        role = lookup(config.strategy).role_of
        # Which other machines no longer answer, asked after the failure: a rank that lost
        # its peer on one names it.
        survey = roster.survey(min(PROBE_S, config.timeout_s)) if roster is not None else None
        message = format_failures(
            e.failures,
            lambda r: role(config, r),
            read_stacks(stacks),
            survey,
            read_finished(stacks),
        )
        raise LaunchError(message, exit_code=exit_code_of(e.failures)) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
