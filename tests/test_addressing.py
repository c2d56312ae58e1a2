"""Which interface a node names to gloo and NCCL, and the check that the rendezvous can be
reached (on this machine's own interfaces and ports; no traffic leaves it)."""

from __future__ import annotations

import socket
import time

import pytest

from dtrain.config import Config
from dtrain.errors import ConfigError, LaunchError
from dtrain.launcher import addressing
from dtrain.launcher.addressing import Rendezvous, choose_interface, locate


@pytest.fixture(autouse=True)
def _no_interface_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in addressing.IFNAME_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def node(rank: int = 1, **options: object) -> Config:
    return Config(nnodes=2, node_rank=rank, master="127.0.0.1:1", **options)  # type: ignore[arg-type]


def outward() -> tuple[str, str]:
    found = [(n, a) for n, a in addressing.interface_addresses().items() if a[:4] != "127."]
    if not found:
        pytest.skip("this machine has only loopback")
    return found[0]


def test_the_interface_that_routes_to_the_rendezvous_is_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert addressing.interface_addresses()["lo"] == "127.0.0.1"
    name, address = outward()
    assert choose_interface(node(), Rendezvous("head", address, 1)) == name
    # One machine, said plainly: gloo and NCCL keep their own choice.
    assert choose_interface(node(), Rendezvous("localhost", "127.0.0.1", 1)) is None
    assert choose_interface(node(), Rendezvous("127.0.0.1", "127.0.0.1", 1)) is None
    # A name that resolves to loopback here (127.0.1.1 HOSTNAME): the outward interface.
    assert choose_interface(node(0), Rendezvous("me", "127.0.1.1", 1)) is not None
    assert choose_interface(node(iface="lo"), Rendezvous("head", address, 1)) == "lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert choose_interface(node(), Rendezvous("head", address, 1)) is None
    with pytest.raises(ConfigError, match="--iface nope0 names no network interface"):
        choose_interface(node(iface="nope0"), Rendezvous("head", address, 1))
    with pytest.raises(ConfigError, match="--iface must name one network interface"):
        node(iface="eth0 eth1")


def test_a_loopback_address_offered_to_other_machines_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on_the_network = Rendezvous("head", "192.0.2.1", 29500)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with pytest.raises(ConfigError, match=r"offer the other nodes 127.0.0.1 \(interface lo\)"):
        addressing.check_offered(node(), on_the_network)
    addressing.check_offered(node(), Rendezvous("localhost", "127.0.0.1", 29500))
    name, _ = outward()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    addressing.check_offered(node(), on_the_network)


def test_an_unreachable_rendezvous_is_named_within_the_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = Config(nnodes=2, node_rank=1, master=f"localhost:{port}", timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(LaunchError) as refused:
        locate(config, wait=True)
    assert time.monotonic() - started < 4
    assert str(refused.value).startswith(
        f"Node 1 could not reach the rendezvous at localhost (127.0.0.1) port {port} within "
        "1.5 s: Connection refused. Check that node 0 runs the same command"
    )
    with pytest.raises(LaunchError, match="could not resolve the rendezvous host no-such.invalid"):
        locate(config.replace(master="no-such.invalid:29500", timeout_s=0.5), wait=True)


def test_a_listening_rendezvous_is_found_and_node_0_does_not_wait() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        found = locate(Config(nnodes=2, node_rank=1, master=f"localhost:{port}"), wait=True)
    assert found == Rendezvous("localhost", "127.0.0.1", port)
    assert found.endpoint == f"127.0.0.1:{port}"
    assert locate(Config(nnodes=2, master=f"127.0.0.1:{port}"), wait=False).port == port


def test_a_rendezvous_that_never_completes_says_what_to_start() -> None:
    from dtrain.launcher.failures import rendezvous_failed

    waited = RuntimeError("Timed out after 31 seconds waiting for clients. 1/3 clients joined.")
    static = Config(nnodes=3, master="head:29500", timeout_s=30)
    assert rendezvous_failed(static, waited).startswith(
        "Node 0 hosted the rendezvous at head:29500 for 30 s, but not all 3 nodes joined "
        "(Timed out after 31 seconds waiting for clients. 1/3 clients joined). Start the "
        "same command on each other machine with its own --node-rank (1 to 2)"
    )
    assert "Node 2 lost the rendezvous at head:29500" in rendezvous_failed(
        static.replace(node_rank=2), waited
    )
    elastic = Config(nnodes=3, min_nnodes=2, master="head:29500", timeout_s=30)
    assert "Fewer than 2 machines met at the rendezvous at head:29500 within 30 s" in (
        rendezvous_failed(elastic, waited)
    )
