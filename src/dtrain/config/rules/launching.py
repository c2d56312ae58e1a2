"""The launch options' own rules: processes, machines, the rendezvous, ssh and restarts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.config.rules.choices import at_least
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config

MAX_TIMEOUT_S = 7 * 24 * 3600
"""The longest --timeout: a week of seconds, far below where torch's timers overflow."""

PORTS = range(1, 65536)
"""The TCP ports --master and --ssh-port may name."""


def default_strategy(config: Config) -> str:
    """The strategy of a config that names none: ddp with more than one process (or any
    -H/--hostfile job), else single."""
    many = config.nproc * config.nnodes > 1 or config.hosts or config.hostfile
    return "ddp" if many else "single"


def check(config: Config) -> None:
    """Raise ConfigError for a launch option that no machine could run."""
    _check_processes(config)
    _check_rendezvous(config)
    _check_hosts(config)
    _check_elastic(config)
    if not 0 < config.timeout_s <= MAX_TIMEOUT_S:  # false for nan too
        raise ConfigError(
            f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S} "
            f"(a week), got {config.timeout_s:g}; the default is 600."
        )


def _check_processes(config: Config) -> None:
    at_least("--nproc", config.nproc)
    at_least("--towers", config.towers)
    if config.towers is not None and config.strategy != "towers":
        raise ConfigError(
            f"--towers sets the replicas of --strategy towers, which --strategy "
            f"{config.strategy} does not use; drop --towers, or use --strategy towers."
        )
    at_least("--nnodes", config.nnodes)
    if not 0 <= config.node_rank < config.nnodes:
        raise ConfigError(
            f"--node-rank must lie in [0, --nnodes), got node rank {config.node_rank} "
            f"of {config.nnodes} node(s)."
        )


def _check_rendezvous(config: Config) -> None:
    if config.nnodes > 1 and not config.master:
        raise ConfigError(
            "A multi-node run needs --master HOST:PORT (node 0's address and a free "
            "port), the same on every node."
        )
    if config.master is None:
        return
    host, _, port = config.master.rpartition(":")
    # port 0 stays allowed: -H's per-host configs leave the port to the launch
    if not host or not (port.isascii() and port.isdigit()) or int(port) > PORTS[-1]:
        raise ConfigError(
            f"--master must be HOST:PORT with a port from 1 to 65535, got "
            f"{config.master!r}; for example --master 10.0.0.1:29500."
        )
    # with -H/--hostfile, _check_hosts says to drop --master
    if config.nnodes == 1 and not (config.hosts or config.hostfile):
        raise ConfigError(
            "--master names node 0's rendezvous for a multi-node job, but --nnodes is 1 "
            "(one machine picks a free local port itself); drop --master, or give --nnodes."
        )


def _check_hosts(config: Config) -> None:
    if config.ssh_port not in PORTS:
        raise ConfigError(
            f"--ssh-port must be a port from 1 to 65535, got {config.ssh_port}; sshd listens "
            "on 22 unless its configuration says otherwise."
        )
    if config.hosts and config.hostfile:
        raise ConfigError(
            "Give the hosts either with -H or with --hostfile, not both; drop one of them."
        )
    if (config.hosts or config.hostfile) and (config.nnodes != 1 or config.master):
        raise ConfigError(
            "-H/--hostfile start every machine from this one and set --nnodes, "
            "--node-rank, --master and --nproc for each; drop those flags."
        )
    if config.iface is not None and (not config.iface or config.iface.split() != [config.iface]):
        raise ConfigError(
            f"--iface must name one network interface such as eth0, got {config.iface!r}."
        )


def _check_elastic(config: Config) -> None:
    if config.min_nnodes is not None and not 1 <= config.min_nnodes <= config.nnodes:
        raise ConfigError(
            f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {config.min_nnodes}:{config.nnodes}."
        )
    if config.min_nnodes is not None and config.node_rank != 0:
        raise ConfigError(
            "--node-rank is not given in an elastic job (--nnodes MIN:MAX): the rendezvous "
            "numbers the machines as they join; drop --node-rank."
        )
    if config.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {config.max_restarts}.")
    if config.last_call_s < 1:
        raise ConfigError(
            f"--last-call must be a whole number of seconds, at least 1, got {config.last_call_s}."
        )
