"""One command starts every machine: the head logs in to each host over ssh and runs
`dtrain.launcher.remote` there, which starts that host's agent and workers.

Each host gets the same Python interpreter, working directory and environment as the
head, its node rank, and the first host's address as the rendezvous. Output comes back
line by line, prefixed with the host's name (and, from the agent, the rank). The head
holds each ssh session's stdin open: closing it (a host failed, Ctrl-C, the head died)
makes every remote launcher stop its workers, so nothing is left running anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

from dtrain.config import Config
from dtrain.errors import JOB_FAILED, ConfigError, LaunchError, Stopped
from dtrain.launcher.hosts import Host, as_nodes
from dtrain.launcher.machines import HOST_NAME_VAR

SSH_OPTIONS_VAR = "DTRAIN_SSH_OPTS"
"""Extra ssh options for every login (e.g. ``-o UserKnownHostsFile=...``)."""

GRACE_S = 15.0
"""Seconds the hosts get to stop their workers before their ssh sessions are killed."""

_KEPT_OUT = frozenset(
    {"HOME", "HOSTNAME", "LOGNAME", "MAIL", "OLDPWD", "PWD", "SHELL", "SHLVL", "TERM", "USER"}
)
_KEPT_OUT_PREFIXES = ("SSH_", "XDG_", "DISPLAY", "LS_COLORS", "_")


def forwarded_environment() -> dict[str, str]:
    """The head's environment as each host should see it (the machine-specific variables
    of a login left to the host)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in _KEPT_OUT and not k.startswith(_KEPT_OUT_PREFIXES)
    }


def ssh_command(host: str, config: Config, remote: str) -> list[str]:
    """The ssh command line that runs `remote` on `host`. Hosts not yet known are
    accepted on first use; BatchMode fails at once instead of asking for a password."""
    command = [
        "ssh",
        "-p",
        str(config.ssh_port),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        f"ConnectTimeout={max(1, int(config.timeout_s))}",
    ]
    if config.ssh_identity:
        command += ["-i", config.ssh_identity]
    command += shlex.split(os.environ.get(SSH_OPTIONS_VAR, ""))
    return [*command, host, remote]


def remote_command() -> str:
    """The shell command each host runs: this interpreter, in this directory."""
    return (
        f"cd {shlex.quote(os.getcwd())} && exec {shlex.quote(sys.executable)} -u -m "
        "dtrain.launcher.remote"
    )


def rendezvous_port(host: Host, config: Config) -> int:
    """A port free on the first host right now, asked of that host itself."""
    probe = (
        f"{shlex.quote(sys.executable)} -c 'import socket; s = socket.socket(); "
        's.bind(("", 0)); print(s.getsockname()[1])\''
    )
    try:
        done = subprocess.run(
            ssh_command(host.name, config, probe),
            capture_output=True,
            text=True,
            timeout=config.timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0 or not done.stdout.strip().isdigit():
        why = "no answer" if done is None else (done.stderr.strip() or done.stdout.strip())
        raise ConfigError(
            f"Could not reach {host.name} over ssh (port {config.ssh_port}) within "
            f"{config.timeout_s:g} s: {why or 'no output'}. Check that sshd runs there, that "
            "your key logs in without a password (--ssh-identity), and --ssh-port."
        )
    return int(done.stdout.split()[-1])


class _Session:
    """One host's ssh session: its process and the thread relaying its output."""

    def __init__(self, node: int, host: Host, config: Config, payload: dict) -> None:
        self.node = node
        self.host = host
        self.process = subprocess.Popen(
            ssh_command(host.name, config, remote_command()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the head only; it stops the hosts
        )
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(payload) + "\n")
        self.process.stdin.flush()
        self.tail: list[str] = []
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.tail = [*self.tail[-20:], line.rstrip("\n")]
            sys.stdout.write(f"[{self.host.name}] {line}")
            sys.stdout.flush()

    def hang_up(self) -> None:
        """Close the session's stdin: the remote launcher stops its workers and exits."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.close()

    def kill(self) -> None:
        """End the local ssh client (and with it the connection)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.relay.join(timeout=5)


def launch_over_ssh(
    config: Config, target: object, hosts: list[Host], min_hosts: int | None = None
) -> None:
    """Run `target` on every host of `hosts` (node ranks in the order given); raise a
    LaunchError naming the first host that failed, Stopped on Ctrl-C or SIGTERM.

    With `min_hosts`, the hosts form an elastic job (``--nnodes min_hosts:len(hosts)``,
    numbered by the rendezvous as they join): a host that fails is left behind while the
    others go on, and the job fails only if no host finishes it. The first host serves
    the rendezvous: if it fails, every host does."""
    port = rendezvous_port(hosts[0], config)
    base = as_nodes(config, hosts).replace(master=f"{hosts[0].name}:{port}", min_nnodes=min_hosts)
    environment = forwarded_environment()
    sessions: list[_Session] = []
    stopped: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, _: stopped.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        for node, host in enumerate(hosts):
            payload = {
                "config": base.replace(node_rank=0 if min_hosts else node).to_json(),
                "target": asdict(target),  # type: ignore[call-overload]
                "env": {**environment, HOST_NAME_VAR: host.name},  # its name in reports
            }
            sessions.append(_Session(node, host, config, payload))
        failed = _wait(sessions, stopped, elastic=min_hosts is not None)
    finally:
        for s in sessions:
            s.hang_up()
        deadline = time.monotonic() + GRACE_S
        for s in sessions:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            s.kill()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        raise Stopped(stopped[0])
    for s in sessions:
        if failed is None and s.process.returncode != 0:
            print(
                f"dtrain: {s.host.name} (node {s.node}) ended with exit code "
                f"{s.process.returncode}; the job finished without it.",
                file=sys.stderr,
            )
    if failed is not None:
        # Every host that failed of itself, not those stopped after it (SIGTERM's code).
        causes = [
            s
            for s in sessions
            if s.process.returncode not in (0, 128 + signal.SIGTERM, -signal.SIGKILL)
        ] or [failed]
        raise LaunchError(
            "\n\n".join(_failure(s, config) for s in causes),
            exit_code=failed.process.returncode or 1,
        )


def _wait(sessions: list[_Session], stopped: list[int], elastic: bool = False) -> _Session | None:
    """Wait until every host is done (None) or one fails (that host) or a signal came.
    Elastic: until every host is done; None if any finished the job, else the first host
    that failed."""
    while not stopped:
        codes = [s.process.poll() for s in sessions]
        if elastic:
            if all(code is not None for code in codes):
                return None if 0 in codes else next(s for s in sessions if s.process.returncode)
            time.sleep(0.1)
            continue
        for session, code in zip(sessions, codes, strict=True):
            if code not in (None, 0):
                return session
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)
    return None


def _failure(session: _Session, config: Config) -> str:
    code = session.process.returncode
    where = f"{session.host.name} (node {session.node})"
    if code == 255 and not any(line.startswith("[rank") for line in session.tail):
        last = session.tail[-1] if session.tail else "no output"
        return (
            f"ssh to {where} failed: {last}. Check that sshd runs there on port "
            f"{config.ssh_port}, that your key logs in without a password (--ssh-identity), "
            "and that the working directory and Python interpreter exist there."
        )
    report = next(
        (session.tail[i + 1 :] for i, line in enumerate(session.tail) if JOB_FAILED in line),
        [],
    )
    return (
        f"{where} ended with exit code {code}; its output above is prefixed with "
        f"[{session.host.name}]. The other hosts were stopped."
        + "".join(f"\n  {line}" for line in report)
    )
