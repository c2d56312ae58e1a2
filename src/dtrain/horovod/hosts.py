"""The hosts `horovodrun` is given (``-H host:slots,...`` or ``--hostfile``), and which of
them name this machine (a job on this machine alone runs without ssh)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError


@dataclass(frozen=True)
class Host:
    """A machine and how many processes it may run."""

    name: str
    slots: int


def _host(text: str, where: str) -> Host:
    name, sep, slots = text.strip().partition(":")
    if not name:
        raise ConfigError(f"{where}: {text!r} names no host; write HOST or HOST:SLOTS.")
    if not sep:
        return Host(name, 1)
    if not slots.isdigit() or int(slots) < 1:
        raise ConfigError(
            f"{where}: the slots in {text!r} must be a positive number; write e.g. {name}:4."
        )
    return Host(name, int(slots))


def parse_hosts(text: str) -> list[Host]:
    """``host1:2,host2:4`` (a host without slots has one)."""
    return [_host(item, "-H") for item in text.split(",") if item.strip()]


def parse_hostfile(path: str) -> list[Host]:
    """One host per line, ``HOST slots=N`` or ``HOST:N`` or ``HOST``; ``#`` starts a comment."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"The hostfile {path} does not exist; check the path given to --hostfile."
        )
    hosts = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}, line {number}"
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        if rest:
            key, _, value = rest.partition("=")
            if key.strip() != "slots" or not value.strip().isdigit() or int(value) < 1:
                raise ConfigError(f"{where}: write 'HOST slots=N' with a positive N, not {text!r}.")
            hosts.append(Host(name, int(value)))
        else:
            hosts.append(_host(name, where))
    if not hosts:
        raise ConfigError(
            f"The hostfile {path} lists no host; add a line such as 'localhost slots=2'."
        )
    return hosts


def local_names() -> set[str]:
    """Names that mean this machine."""
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    hostname = socket.gethostname()
    names |= {hostname, hostname.split(".")[0], socket.getfqdn()}
    return names


def this_machine(hosts: list[Host]) -> Host:
    """The one host of `hosts`, all of which name this machine; ConfigError if it is
    listed more than once."""
    if len(hosts) > 1:
        raise ConfigError(
            f"The hosts {', '.join(h.name for h in hosts)} all name this machine; list it once, "
            f"with all its slots (-H localhost:{sum(h.slots for h in hosts)})."
        )
    return hosts[0]
