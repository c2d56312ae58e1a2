"""An sshd of the tests' own: a host key and a client key made for the session, listening
on one address (in a network namespace when given), with its own known_hosts file.

`ssh_environment(daemon)` gives the variables that make dtrain's ssh launch log in with
that key and known_hosts (`DTRAIN_SSH_OPTS`), leaving the user's ~/.ssh alone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def why_no_sshd() -> str | None:
    """Why these tests cannot start an sshd here, or None if they can."""
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        return (
            "openssh-server and openssh-client are not installed (apt-get install openssh-server)"
        )
    if os.geteuid() != 0:
        return "starting sshd needs root"
    return None


@dataclass
class Sshd:
    """A running test sshd."""

    process: subprocess.Popen
    port: int
    identity: Path
    known_hosts: Path

    def stop(self) -> None:
        """End the daemon (and the sessions it forked)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _keys(folder: Path) -> tuple[Path, Path]:
    host, client = folder / "host_key", folder / "client_key"
    for key in (host, client):
        if not key.exists():
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True
            )
    (folder / "authorized_keys").write_text(client.with_suffix(".pub").read_text())
    return host, client


def start_sshd(folder: Path, address: str, port: int, netns: str | None = None) -> Sshd:
    """Start sshd on `address`:`port` (inside `netns` when given); root logs in with the
    client key only."""
    folder.mkdir(parents=True, exist_ok=True)
    host_key, client_key = _keys(folder)
    config = folder / f"sshd_{address}_{port}.conf"
    config.write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {host_key}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        f"StrictModes no\nPidFile {folder / f'sshd_{address}_{port}.pid'}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    command = [SSHD, "-D", "-e", "-f", str(config)]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    daemon = Sshd(process, port, client_key, folder / "known_hosts")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _listening(address, port, netns):
        time.sleep(0.1)
    return daemon


def _listening(address: str, port: int, netns: str | None) -> bool:
    if netns is None:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return True
        except OSError:
            return False
    probe = ["ip", "netns", "exec", netns, "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"]
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


def ssh_environment(daemon: Sshd) -> dict[str, str]:
    """Environment for a dtrain head that logs in to `daemon`'s hosts."""
    return {
        "DTRAIN_SSH_OPTS": f"-o UserKnownHostsFile={daemon.known_hosts} -o LogLevel=ERROR",
    }
