"""The machines of a job started from one command: ``-H host:slots,...`` or a hostfile.

A hostfile holds one host per line, ``HOST slots=N`` as DeepSpeed and OpenMPI write them
(``HOST:N`` and a bare ``HOST`` work too); ``#`` starts a comment. Without a slot count a
host runs ``--nproc`` processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dtrain.config import Config
from dtrain.errors import ConfigError

_LINE = re.compile(r"^(?P<host>[^\s:=]+)(?::(?P<colon>\S+)|\s+slots\s*=\s*(?P<slots>\S+))?$")


@dataclass(frozen=True)
class Host:
    """One machine of the job: the name ssh reaches it by, and its processes."""

    name: str
    slots: int


def _host(text: str, default_slots: int, where: str) -> Host:
    match = _LINE.match(text.strip())
    count = match and (match["colon"] or match["slots"])
    try:
        slots = int(count) if count else default_slots
    except ValueError:
        slots = 0
    if match is None or slots < 1:
        raise ConfigError(
            f"Cannot read the host {text.strip()!r} ({where}); write HOST:SLOTS on the "
            "command line or 'HOST slots=N' in a hostfile, with N at least 1."
        )
    return Host(match["host"], slots)


def parse_hosts(entries: list[str], default_slots: int) -> list[Host]:
    """The hosts of ``-H a:2,b:2`` (already split at commas)."""
    hosts = [_host(e, default_slots, "-H") for e in entries]
    _check(hosts, "-H")
    return hosts


def read_hostfile(path: str | Path, default_slots: int) -> list[Host]:
    """The hosts of a hostfile."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"Cannot read the hostfile {path}: {e.strerror}; check the path given to --hostfile."
        ) from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(_host(line, default_slots, f"{path}, line {number}"))
    _check(hosts, str(path))
    return hosts


def _check(hosts: list[Host], where: str) -> None:
    if not hosts:
        raise ConfigError(f"No host is listed in {where}; list at least one HOST:SLOTS.")
    names = [h.name for h in hosts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"The host(s) {', '.join(twice)} appear more than once in {where}; list each "
            "machine once with all its slots (HOST:SLOTS)."
        )
    if len({h.slots for h in hosts}) > 1:
        shown = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ConfigError(
            f"The hosts offer different numbers of slots ({shown}); every machine runs the "
            "same number of processes, so give each host the same count."
        )


def hosts_of(config: Config) -> list[Host] | None:
    """The hosts of -H or --hostfile, or None when the job runs on this machine alone."""
    if config.hosts:
        return parse_hosts(config.hosts, config.nproc)
    if config.hostfile:
        return read_hostfile(config.hostfile, config.nproc)
    return None


def as_nodes(config: Config, hosts: list[Host]) -> Config:
    """`config` as each host will run it: --nnodes and --nproc from the hosts (the
    rendezvous address is settled at launch)."""
    return config.replace(
        hosts=None,
        hostfile=None,
        nnodes=len(hosts),
        nproc=hosts[0].slots,
        master=f"{hosts[0].name}:0",
    )
