"""The machines of a multi-machine job, so that a failure names the one that was lost.

A rank whose peer on another machine went away (its link cut, the machine frozen or
off) fails with gloo's or NCCL's words only: a collective that timed out, or a connection
closed by an address. To say which machine that was, and which ranks lived there:

- each machine's launcher holds a *beacon*, a port that accepts connections while the
  launcher runs, and, each time its workers start, publishes in the job's store (the
  one the agents share) its node rank, the name it was given (``-H``, ``--master``),
  its address, the beacon's port and its workers' ranks, and reads every other
  machine's entry (`Roster.gather`, run by the agent just before it starts the workers);
- when the job fails, the launcher knocks at every other machine's beacon
  (`Roster.survey`): one that neither accepts nor refuses within a couple of seconds
  (a refusal comes from a live machine whose launcher has ended) is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

import torch.distributed.launcher.api as launcher_api

from dtrain.config import Config
from dtrain.launcher import addressing

HOST_NAME_VAR = "DTRAIN_HOST_NAME"
"""Environment variable: the name this machine was given in -H or --hostfile."""

PROBE_S = 2.0
"""Seconds a machine has to answer the launcher's knock before it counts as lost."""

_KEY = "dtrain/machine/"


@dataclass(frozen=True)
class Machine:
    """One machine of the job, as its launcher published itself."""

    node: int
    name: str  # as the user gave it (-H, --hostfile, --master); "" if not given
    hostname: str  # its own idea of its name, if nothing better is known
    address: str  # the address its workers use to reach the other machines
    port: int  # its launcher's beacon
    ranks: tuple[int, ...]

    def describe(self) -> str:
        """``NAME (ADDRESS)`` for messages."""
        name = self.name or self.hostname
        return self.address if name in ("", self.address) else f"{name} ({self.address})"

    def held(self) -> str:
        """``rank 3``, ``ranks 2-3`` or ``ranks 0, 2, 5``: the ranks it ran."""
        ranks = sorted(self.ranks)
        if len(ranks) == 1:
            return f"rank {ranks[0]}"
        if ranks == list(range(ranks[0], ranks[-1] + 1)):
            return f"ranks {ranks[0]}-{ranks[-1]}"
        return f"ranks {', '.join(map(str, ranks))}"


@dataclass(frozen=True)
class Survey:
    """What a failed job's launcher found out about the other machines."""

    others: tuple[Machine, ...]  # every other machine of the job, named
    silent: tuple[Machine, ...]  # those among them that did not answer
    rendezvous: Machine | None  # the machine that hosts the rendezvous, if known
    elastic: bool  # an elastic job (--nnodes MIN:MAX)

    def at(self, address: str) -> Machine | None:
        """The other machine at `address`, if one is."""
        return next((m for m in self.others if m.address == address), None)


def roster_of(config: Config, endpoint: str) -> Roster | None:
    """A roster for this machine of a job of several machines with its rendezvous at
    ``ADDRESS:PORT`` `endpoint`; None for a job on one machine."""
    if config.nnodes == 1:
        return None
    assert config.master is not None
    rendezvous, _ = addressing.split_master(endpoint)
    # The address the workers offer their peers: that of the interface gloo was told to
    # use (addressing.choose_interface), else the one that routes to the rendezvous.
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    address = addressing.interface_addresses().get(interface) if interface else None
    address = address or addressing.source_address(rendezvous)
    name = os.environ.get(HOST_NAME_VAR, "")
    if not name and not addressing.is_loopback(rendezvous) and addressing.is_local(rendezvous):
        name = addressing.split_master(config.master)[0]  # this machine is --master's
    return Roster(name, address, rendezvous, config.min_nnodes is not None, config.timeout_s)


class Roster:
    """This job's machines as this launcher knows them (see the module's doc).

    `name` is what the user called this machine ("" if nothing), `address` the one its
    workers reach the others from, `rendezvous_address` where the rendezvous is.
    """

    def __init__(
        self, name: str, address: str, rendezvous_address: str, elastic: bool, wait_s: float
    ) -> None:
        self.name = name
        self.address = address
        self.rendezvous_address = rendezvous_address
        self.elastic = elastic
        self.wait_s = wait_s
        self.port = 0
        self.node: int | None = None
        self.machines: dict[int, Machine] = {}

    def gather(self, store: Any, node: int, nodes: int, ranks: list[int]) -> None:
        """Publish this machine as node `node` (running `ranks`) in `store`, and read the
        entries of all `nodes` machines; a machine that does not publish within the wait
        (it died since the rendezvous) leaves the roster without the others."""
        me = Machine(node, self.name, socket.gethostname(), self.address, self.port, tuple(ranks))
        self.node, self.machines = node, {node: me}
        store.set(f"{_KEY}{node}", json.dumps(asdict(me)))
        keys = [f"{_KEY}{n}" for n in range(nodes)]
        try:
            store.wait(keys, timedelta(seconds=self.wait_s))
            entries = [json.loads(value) for value in store.multi_get(keys)]
            machines = [Machine(**{**e, "ranks": tuple(e["ranks"])}) for e in entries]
        except (RuntimeError, ValueError, TypeError, KeyError):
            # A store error (the workers meet it too, and say so), or an entry written by
            # another version of dtrain: the report names no machine then.
            return
        self.machines = {machine.node: machine for machine in machines}

    def survey(self, within_s: float = PROBE_S) -> Survey | None:
        """Knock at every other machine's beacon at once; None if no other is known."""
        others = [m for n, m in sorted(self.machines.items()) if n != self.node]
        if not others:
            return None
        answered: dict[int, bool] = {}
        names: dict[int, str] = {}

        def knock(machine: Machine) -> None:
            answered[machine.node] = _answers(machine, within_s)
            if not machine.name:
                with contextlib.suppress(OSError):  # no name for it: its own hostname serves
                    names[machine.node] = socket.gethostbyaddr(machine.address)[0]

        threads = [threading.Thread(target=knock, args=(m,), daemon=True) for m in others]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + within_s + 1.0  # a name lookup gets a second more
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        named = {m.node: replace(m, name=m.name or names.get(m.node, "")) for m in others}
        machines = {**self.machines, **named}
        # A fixed job's node 0 hosts its rendezvous; an elastic job's, the machine at the
        # --master address, whichever node it became.
        rendezvous = machines.get(0)
        if self.elastic:
            at = self.rendezvous_address
            rendezvous = next((m for m in machines.values() if m.address == at), None)
        return Survey(
            others=tuple(named.values()),
            silent=tuple(m for m in named.values() if not answered.get(m.node, False)),
            rendezvous=rendezvous,
            elastic=self.elastic,
        )


def _answers(machine: Machine, within_s: float) -> bool:
    """Whether `machine` answers a connection to its beacon within `within_s`: accepted,
    or refused by its kernel (it is up, its launcher has ended)."""
    try:
        with socket.create_connection((machine.address, machine.port), timeout=within_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:  # no answer in time, no route to it
        return False


@contextlib.contextmanager
def gathering(roster: Roster) -> Iterator[None]:
    """While inside, this machine's beacon answers (its port in `roster.port`), and each
    start of the workers by the agent running in this process first gathers the machines
    into `roster` (`Roster.gather`)."""
    with _beacon(roster), _agent_gathers(roster):
        yield


@contextlib.contextmanager
def _beacon(roster: Roster) -> Iterator[None]:
    """A port on every address of this machine that accepts connections (and closes
    them): the other machines knock there to tell a machine that is gone from one that
    is not."""
    listener = socket.create_server(("", 0), backlog=64)

    def answer() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # shut down: the job is over
                return
            connection.close()

    thread = threading.Thread(target=answer, name="dtrain-beacon", daemon=True)
    thread.start()
    roster.port = listener.getsockname()[1]
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        listener.close()
        thread.join(timeout=5)


@contextlib.contextmanager
def _agent_gathers(roster: Roster) -> Iterator[None]:
    """torch's launcher builds its agent from this module-level name; `_start_workers` is
    the hook torch documents for agents of one's own."""
    saved = launcher_api.LocalElasticAgent

    class Agent(saved):  # type: ignore[misc, valid-type]
        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            roster.gather(
                worker_group.store,
                worker_group.group_rank,
                worker_group.group_world_size,
                [worker.global_rank for worker in worker_group.workers],
            )
            return super()._start_workers(worker_group)

    launcher_api.LocalElasticAgent = Agent  # type: ignore[misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved  # type: ignore[misc]
