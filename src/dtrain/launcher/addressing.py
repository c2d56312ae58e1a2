"""Which network a multi-node job uses, and a check that the rendezvous can be reached.

gloo and NCCL advertise to their peers the address this machine's hostname resolves to,
unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface. On many real
clusters (Debian's installer writes ``127.0.1.1 HOSTNAME`` in /etc/hosts) that address is
a loopback one, which no other machine can reach, so the first collective fails or waits.
Before its workers start, each node therefore picks the interface that routes to the
rendezvous address (the one the node will talk to its peers through) and names it to gloo
and NCCL, unless the user named one (``--iface``, or those variables already set).

A node other than 0 also connects to the rendezvous before it starts anything, retrying
until ``--timeout``, so a host that cannot reach node 0 says which host, address and port
failed instead of waiting without a word.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass

from dtrain.config import Config
from dtrain.errors import ConfigError, LaunchError

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux: read an interface's IPv4 address
_RETRY_S = 0.5


@dataclass(frozen=True)
class Rendezvous:
    """Where node 0 hosts the job's rendezvous, as this node reaches it."""

    host: str
    address: str
    port: int

    @property
    def endpoint(self) -> str:
        """``ADDRESS:PORT``: the address this node checked, so its agent and its workers
        reach the same place whatever a later name lookup would say."""
        return f"{self.address}:{self.port}"

    def describe(self) -> str:
        """``HOST (ADDRESS) port PORT`` for messages."""
        where = self.host if self.host == self.address else f"{self.host} ({self.address})"
        return f"{where} port {self.port}"


def split_master(master: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` too) as (host, port)."""
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


def resolve(host: str) -> str:
    """The IPv4 address `host` resolves to here; OSError if it does not (yet)."""
    return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP) is one of this machine's loopback addresses."""
    return ipaddress.ip_address(address).is_loopback


def source_address(address: str) -> str:
    """The local address this machine sends from to reach `address` (the kernel's route
    choice: connecting a UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """Each interface of this machine that has an IPv4 address, with that address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # down, or no IPv4 address
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The interface that holds the local `address`, or None."""
    return next((name for name, a in interface_addresses().items() if a == address), None)


def outward_interface() -> str | None:
    """The interface of the default route, else the first one not on loopback; None when
    this machine has only loopback."""
    try:
        found = interface_of(source_address("192.0.2.1"))  # TEST-NET-1: never contacted
    except OSError:  # no default route
        found = None
    if found is not None:
        return found
    return next((n for n, a in interface_addresses().items() if not is_loopback(a)), None)


def choose_interface(config: Config, rendezvous: Rendezvous) -> str | None:
    """The interface this node's workers should use, or None to leave gloo and NCCL alone.

    ``--iface`` wins, then interfaces already named in the environment. A rendezvous given
    as ``localhost`` or a loopback address means one machine: nothing to choose. A name
    that resolves to loopback here is this machine's own name on a cluster whose hosts
    files say so: the interface of the default route carries the traffic. Otherwise the
    interface that routes to the rendezvous does.
    """
    if config.iface is not None:
        if config.iface not in {name for _, name in socket.if_nameindex()}:
            known = ", ".join(name for _, name in socket.if_nameindex())
            raise ConfigError(
                f"--iface {config.iface} names no network interface of this machine (node "
                f"{config.node_rank}); it has {known}. Pick the one that reaches the other "
                "nodes, or drop --iface to let dtrain pick the one that routes to --master."
            )
        return config.iface
    if any(os.environ.get(name) for name in IFNAME_VARIABLES):
        return None
    if is_loopback(rendezvous.address):
        literal = rendezvous.host == "localhost" or rendezvous.host == rendezvous.address
        return None if literal else outward_interface()
    return interface_of(source_address(rendezvous.address))


def use_interface(name: str | None) -> None:
    """Name `name` to gloo and NCCL for the workers this process starts."""
    if name is not None:
        for variable in IFNAME_VARIABLES:
            os.environ[variable] = name


def check_offered(config: Config, rendezvous: Rendezvous) -> None:
    """Refuse, before any worker starts, a node whose workers would offer their peers a
    loopback address while the rendezvous is on the network: gloo would otherwise wait
    up to five times --timeout for connections that cannot come."""
    if is_loopback(rendezvous.address):
        return
    named = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    try:
        offered = interface_addresses().get(named) if named else resolve(socket.gethostname())
    except OSError:
        return
    if offered is None or not is_loopback(offered):
        return
    source = f"interface {named}" if named else f"its hostname {socket.gethostname()}"
    raise ConfigError(
        f"Node {config.node_rank}'s workers would offer the other nodes {offered} ({source}), "
        f"a loopback address they cannot reach, while the rendezvous is at "
        f"{rendezvous.describe()}. Drop --iface (and GLOO_SOCKET_IFNAME) to let dtrain pick "
        "the interface that routes to --master, or name one that reaches the other machines."
    )


def is_local(address: str) -> bool:
    """Whether `address` belongs to this machine (it can listen there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
        return True


def check_port_free(port: int) -> None:
    """Raise ConfigError if node 0 could not listen on `port`: a live listener holds it, or
    it is a privileged port. The probe binds and listens with SO_REUSEADDR, as the
    rendezvous's own listener does, so the TIME-WAIT sockets that a job restarted on the
    same port leaves behind for a minute do not count as in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen()
        except OSError as e:
            if e.errno == errno.EACCES:
                raise ConfigError(
                    f"Port {port} is reserved for the superuser on this machine, so node 0 "
                    "cannot host the rendezvous there; pick a port from 1024 to 65535 in "
                    "--master HOST:PORT (the same on every node)."
                ) from None
            raise ConfigError(
                f"Port {port} is already in use on this machine (a program listens on it), "
                "so node 0 cannot host the rendezvous there; pick a free port in --master "
                "HOST:PORT (the same on every node), or stop that program."
            ) from None


def locate(config: Config, wait: bool) -> Rendezvous:
    """Resolve ``--master`` on this node; with `wait` (a node that does not host the
    rendezvous), also connect to it, retrying until ``--timeout``. Raises LaunchError
    naming what could not be reached."""
    assert config.master is not None
    host, port = split_master(config.master)
    deadline = time.monotonic() + config.timeout_s
    while True:
        try:
            rendezvous = Rendezvous(host, resolve(host), port)
            if wait:
                _connect(rendezvous, deadline)
            return rendezvous
        except OSError as e:
            if time.monotonic() + _RETRY_S >= deadline:
                raise LaunchError(_unreachable(config, host, port, e)) from None
            time.sleep(_RETRY_S)


def check_node0_hosts(config: Config, rendezvous: Rendezvous) -> None:
    """Warn when node 0 is not the machine ``--master`` names: the other nodes would wait
    for a rendezvous this machine hosts at another address."""
    if config.node_rank != 0 or config.min_nnodes is not None:
        return
    if not is_loopback(rendezvous.address) and not is_local(rendezvous.address):
        print(
            f"dtrain: warning: --master names {rendezvous.describe()}, which is not an "
            "address of this machine, yet this is node 0, the node that hosts the "
            "rendezvous. Unless that address reaches this machine (a forwarded port), "
            "run --node-rank 0 on the machine --master names.",
            file=sys.stderr,
            flush=True,
        )


def _connect(rendezvous: Rendezvous, deadline: float) -> None:
    left = max(0.1, min(deadline - time.monotonic(), 5.0))
    with socket.create_connection((rendezvous.address, rendezvous.port), timeout=left):
        pass


def _unreachable(config: Config, host: str, port: int, error: OSError) -> str:
    seconds = f"{config.timeout_s:g} s"
    try:
        where = Rendezvous(host, resolve(host), port).describe()
    except OSError:
        return (
            f"Node {config.node_rank} could not resolve the rendezvous host {host} (from "
            f"--master {config.master}) within {seconds}: {error.strerror or error}. Check "
            "the name (or give node 0's IP address) and this machine's DNS or hosts file."
        )
    why = error.strerror or str(error) or type(error).__name__
    return (
        f"Node {config.node_rank} could not reach the rendezvous at {where} within "
        f"{seconds}: {why}. Check that node 0 runs the same command with --node-rank 0 on "
        f"{host}, that --master names node 0 and the same port on every node, and that no "
        "firewall blocks the port; raise --timeout if node 0 starts later."
    )
