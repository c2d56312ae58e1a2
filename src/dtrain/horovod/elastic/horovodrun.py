"""How ``horovodrun``'s elastic flags map onto dtrain's launcher.

Horovod's elastic driver keeps the surviving processes and adds or removes workers one
slot at a time. dtrain's launcher (torch's elastic agent) restarts the whole worker group
after a failure, and adds or removes whole machines at a restart (``--nnodes MIN:MAX``).
So on one machine an elastic run is a run of -np processes restarted up to
``--reset-limit`` times; on several, ``--min-np``/``--max-np`` become the fewest and most
machines, and must therefore count whole machines' slots.
"""

from __future__ import annotations

import argparse
import subprocess

from dtrain.errors import ConfigError
from dtrain.horovod.hosts import Host

DEFAULT_RESET_LIMIT = 3
"""Restarts of the worker group an elastic run allows when --reset-limit is not given
(Horovod's default is no limit, which lets a script that always fails run forever)."""

DISCOVERY_TIMEOUT_S = 60.0
"""Seconds --host-discovery-script may take."""


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the command line asks for an elastic run."""
    return any(
        getattr(args, name) is not None for name in ("min_np", "max_np", "host_discovery_script")
    )


def reset_limit(args: argparse.Namespace) -> int:
    """The launcher's --max-restarts: --reset-limit, else `DEFAULT_RESET_LIMIT` for an
    elastic run, else none."""
    if args.reset_limit is not None:
        if args.reset_limit < 0:
            raise ConfigError(
                f"--reset-limit must be 0 or more, got {args.reset_limit}; give how many "
                "times the workers may be restarted."
            )
        return args.reset_limit
    return DEFAULT_RESET_LIMIT if is_elastic(args) else 0


def check_counts(args: argparse.Namespace, nproc: int) -> None:
    """--min-np <= -np <= --max-np, all at least 1; ConfigError naming the fix if not."""
    low = args.min_np if args.min_np is not None else 1
    high = args.max_np if args.max_np is not None else nproc
    if low < 1 or high < low:
        raise ConfigError(
            f"--min-np {low} and --max-np {high} must satisfy 1 <= --min-np <= --max-np; "
            "fix the pair."
        )
    if not low <= nproc <= high:
        raise ConfigError(
            f"-np {nproc} lies outside --min-np {low} .. --max-np {high}; give an -np in "
            "that range (the processes the job starts with)."
        )


def local_processes(args: argparse.Namespace, slots: int | None) -> int | None:
    """Processes on this machine when -np is not given: the host's slots, else --max-np,
    else --min-np (None: nothing says)."""
    if args.np is not None:
        return args.np
    if slots is not None:
        return slots
    return args.max_np if args.max_np is not None else args.min_np


def machine_range(args: argparse.Namespace, hosts: list[Host]) -> tuple[int, int]:
    """(fewest, most) machines of an elastic run on several hosts of S slots each:
    --min-np / S and --max-np / S (default: 1 machine and every host)."""
    slots = hosts[0].slots
    low = args.min_np if args.min_np is not None else slots
    high = args.max_np if args.max_np is not None else slots * len(hosts)
    check_counts(args, args.np if args.np is not None else high)
    if low % slots or high % slots:
        raise ConfigError(
            f"--min-np {low} and --max-np {high} must be multiples of the {slots} slots of "
            "each host: on several machines dtrain adds and removes whole machines (at a "
            f"restart of the group), so give e.g. --min-np {max(1, low // slots) * slots} "
            f"--max-np {max(1, high // slots) * slots}, or change the slots per host."
        )
    total = slots * len(hosts)
    if args.np is not None and args.np != total:
        raise ConfigError(
            f"-np {args.np} does not match the {total} slots of the {len(hosts)} hosts: on "
            "several machines every listed host starts with all its slots, so give -np "
            f"{total}, or list the hosts the job should start on."
        )
    if high // slots < len(hosts):
        raise ConfigError(
            f"{len(hosts)} hosts of {slots} slots run {len(hosts) * slots} processes, more "
            f"than --max-np {high}; list at most {high // slots} hosts, or raise --max-np to "
            f"{len(hosts) * slots} (spare hosts that wait for a failure are not supported)."
        )
    return low // slots, len(hosts)


def discover_hosts(script: str, slots_per_host: int | None) -> list[Host]:
    """Run --host-discovery-script once and read its ``HOST`` or ``HOST:SLOTS`` lines (a
    host without a count gets --slots-per-host, else 1)."""
    try:
        done = subprocess.run(
            script, shell=True, capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"--host-discovery-script {script} gave no answer within {DISCOVERY_TIMEOUT_S:g} "
            "s; make it print the available hosts (HOST:SLOTS, one a line) and exit."
        ) from None
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(
            f"--host-discovery-script {script} failed with exit code {done.returncode} "
            f"({why[0]}); run it by hand and fix it (it must print HOST:SLOTS lines)."
        )
    hosts = [_discovered(line, slots_per_host, script) for line in done.stdout.splitlines()]
    hosts = [h for h in hosts if h is not None]
    if not hosts:
        raise ConfigError(
            f"--host-discovery-script {script} printed no host; it must print one HOST:SLOTS "
            "line per available machine."
        )
    return hosts


def _discovered(line: str, slots_per_host: int | None, script: str) -> Host | None:
    text = line.strip()
    if not text:
        return None
    name, sep, count = text.partition(":")
    if not sep:
        return Host(name, slots_per_host or 1)
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(
            f"--host-discovery-script {script} printed {text!r}; each line must be HOST or "
            "HOST:SLOTS with SLOTS a positive number."
        )
    return Host(name, int(count))
