"""Test hosts on one machine: network namespaces joined by a bridge, with shaped links.

Each host is a network namespace with its own loopback and one interface (``eth0``, a
veth pair whose other end sits on a bridge in a namespace of its own), a private address
``10.77.0.K/24`` that exists only inside the namespaces, and a hosts file
(``/etc/netns/NS/hosts``, which ``ip netns exec`` shows as ``/etc/hosts``) where the
machine's own hostname resolves to 127.0.1.1, as on many real clusters, and every test
host's name (``dt-h1``, ``dt-h2``, ...) to its address. A process started in a host with
:meth:`Cluster.popen` sees only that host's network.

Namespaces carry the id of the test process that made them (``dtc<pid>-...``), so a
cluster left behind by a killed run is found and removed by the next one, and clusters
of test sessions running side by side never touch each other.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dtc"
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Host:
    """One test host: its name on the test network, namespace and address."""

    name: str
    netns: str
    address: str


class Cluster:
    """`size` test hosts on a bridge; use :func:`cluster` to get one torn down for sure."""

    def __init__(self, size: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.bridge = f"{self.tag}-br"
        self.hosts = [
            Host(f"dt-h{k}", f"{self.tag}-h{k}", f"{SUBNET}.{k}") for k in range(1, size + 1)
        ]
        self._processes: list[subprocess.Popen[str]] = []

    def build(self, rate: str | None = None) -> None:
        """Make the bridge and the hosts, their egress shaped to `rate` if given."""
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        hosts_file = "".join(
            [
                "127.0.0.1 localhost\n",
                f"127.0.1.1 {socket.gethostname()}\n",
                *(f"{h.address} {h.name}\n" for h in self.hosts),
            ]
        )
        for k, host in enumerate(self.hosts, start=1):
            _ip("netns", "add", host.netns)
            # Both ends are made inside namespaces: no name is ever added to the machine's.
            _ip("-n", self.bridge, "link", "add", f"v{k}", "type", "veth", "peer", "name",
                "eth0", "netns", host.netns)  # fmt: skip
            _ip("-n", self.bridge, "link", "set", f"v{k}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts_file)
            if rate is not None:
                self.shape(host, rate)

    def host(self, name: str) -> Host:
        """The host called `name` (``dt-h1``...)."""
        return next(h for h in self.hosts if h.name == name)

    def shape(self, host: Host, rate: str) -> None:
        """Limit `host`'s egress to `rate` (tc's syntax, e.g. ``100mbit``) with a token
        bucket; netem is not available in every kernel, tbf is."""
        subprocess.run(
            ["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0",
             "root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip

    def popen(self, host: Host, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start `argv` inside `host` (its own session, so it can be stopped as a group)."""
        proc = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", host.netns, *argv],
            start_new_session=True,
            text=True,
            **kwargs,
        )
        self._processes.append(proc)
        return proc

    def kill(self, host: Host) -> None:
        """Kill `host` outright: SIGKILL every process in it, as when a machine dies."""
        _kill_inside(host.netns)

    def close(self) -> None:
        """Stop every process started in the hosts, then remove the hosts and the bridge."""
        for proc in self._processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        remove(self.tag)


def dtrain_command(*args: str) -> list[str]:
    """The argv of ``dtrain ARGS`` with this test's Python (and so its dtrain)."""
    return [sys.executable, "-m", "dtrain.cli", *args]


def job_env() -> dict[str, str]:
    """This test's environment for a `dtrain` command in a host: no config inherited from
    an enclosing job, unbuffered output, one thread per process (the hosts share cores)."""
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_CONFIG"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _kill_inside(netns: str) -> None:
    """SIGKILL whatever still runs in `netns` (a worker its launcher lost, say)."""
    for _ in range(10):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove(tag: str) -> None:
    """Remove every namespace (and hosts file) whose name starts with `tag`."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()]
    for name in names:
        if name.startswith(tag + "-"):
            _kill_inside(name)
            _ip("netns", "delete", name, check=False)
    for folder in NETNS_ETC.glob(f"{tag}-*") if NETNS_ETC.is_dir() else ():
        shutil.rmtree(folder, ignore_errors=True)


def sweep() -> None:
    """Remove the clusters of test processes that are gone (killed before they tidied)."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()]
    folders = [p.name for p in NETNS_ETC.glob(f"{PREFIX}*")] if NETNS_ETC.is_dir() else []
    for name in {*names, *folders}:
        owner = name[len(PREFIX) :].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            remove(name.rsplit("-", 1)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "test hosts need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"test hosts need iproute2's `{tool}`, which is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


@contextlib.contextmanager
def cluster(size: int, rate: str | None = None) -> Iterator[Cluster]:
    """`size` test hosts, their links shaped to `rate` if given; torn down on the way out,
    whatever happened, with every process left in them killed."""
    sweep()
    made = Cluster(size)
    try:
        made.build(rate)
        yield made
    finally:
        made.close()
