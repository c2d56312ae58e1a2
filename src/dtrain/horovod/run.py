"""``horovodrun``: Horovod's launcher, on dtrain's.

    horovodrun -np N [-H host:slots,... | --hostfile F] [-p PORT] [-i KEY] python script.py ARGS
    horovodrun -np N --min-np A --max-np B [--reset-limit R] python elastic_script.py

It starts N processes through dtrain's launcher (torch's elastic agent, which names a
failing rank with its traceback and stops the others): on this machine, or, when the hosts
name other machines, on every host over ssh (dtrain's -H launch: every slot runs a
process). Each runs the script after setting Horovod's variables (HOROVOD_RANK,
HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK,
HOROVOD_CROSS_SIZE, HOROVOD_HOSTNAME). Elastic runs restart the worker group after a
failure (see `dtrain.horovod.elastic.horovodrun`). MPI is refused, saying what to use.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from dtrain.advice import HOROVODRUN, running_as
from dtrain.config import MAX_TIMEOUT_S, Config
from dtrain.errors import ConfigError, DtrainError, exit_report
from dtrain.horovod import basics
from dtrain.horovod.elastic import durable
from dtrain.horovod.elastic.horovodrun import (
    check_counts,
    discover_hosts,
    is_elastic,
    local_processes,
    machine_range,
    reset_limit,
)
from dtrain.horovod.hosts import Host, local_names, parse_hostfile, parse_hosts, this_machine
from dtrain.horovod.output import OUTPUT_VAR
from dtrain.launcher.hosts import hosts_of
from dtrain.launcher.runner import Target, launch

API_VERSION = "0.28.1"
"""The Horovod release whose command line and PyTorch API this follows."""

_PYTHON = re.compile(r"python[0-9.]*(\.exe)?$")
_PYTHON_SWITCHES = {"-u", "-B", "-E", "-s", "-S", "-O", "-OO", "-I", "-q"}
_REFUSED = {
    "mpi": "--mpi asks for MPI, which dtrain does not use; drop it (dtrain runs on gloo, and "
    "NCCL on GPUs, like horovodrun --gloo).",
    "jsrun": "--jsrun asks for IBM's jsrun, which dtrain does not use; drop it to launch "
    "with dtrain's launcher.",
}
_ACCEPTED_KNOBS = {
    "cycle_time_ms": "HOROVOD_CYCLE_TIME",
    "cache_capacity": "HOROVOD_CACHE_CAPACITY",
    "log_level": "HOROVOD_LOG_LEVEL",
}


def build_parser() -> argparse.ArgumentParser:
    """horovodrun's command line (the flags Horovod's users pass, and the command)."""
    parser = argparse.ArgumentParser(
        prog="horovodrun",
        description="Run a Horovod training script on dtrain: N processes on this machine, "
        "or on every host of -H/--hostfile over ssh.",
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--version", action="store_true", help="Print the version.")
    parser.add_argument("-np", "--num-proc", type=int, dest="np", help="Processes to start.")
    parser.add_argument("-H", "--hosts", help="host:slots,... (other machines over ssh).")
    parser.add_argument("--hostfile", help="File of 'HOST slots=N' lines.")
    parser.add_argument("-p", "--ssh-port", type=int, help="SSH port of the other hosts.")
    parser.add_argument("-i", "--ssh-identity-file", help="SSH key for the other hosts.")
    parser.add_argument(
        "--start-timeout", type=int, help="Seconds the processes may take to start (accepted)."
    )
    parser.add_argument(
        "--gloo-timeout-seconds",
        type=float,
        help="Seconds a collective may wait before the job is reported hung (default 600).",
    )
    parser.add_argument("--gloo", action="store_true", help="Use gloo (always the case).")
    parser.add_argument("--mpi", action="store_true", help="Refused: dtrain has no MPI.")
    parser.add_argument("--jsrun", action="store_true", help="Refused: dtrain has no jsrun.")
    parser.add_argument(
        "--network-interface", "--network-interfaces", dest="nics", help="Accepted; unused."
    )
    parser.add_argument("--verbose", action="store_true", help="Accepted.")
    parser.add_argument("--disable-cache", action="store_true", help="Accepted.")
    parser.add_argument("--check-build", action="store_true", help="Print what is supported.")
    parser.add_argument("--log-level", help="Sets HOROVOD_LOG_LEVEL for the processes.")
    parser.add_argument(
        "--fusion-threshold-mb", type=float, help="Sets HOROVOD_FUSION_THRESHOLD (in bytes)."
    )
    parser.add_argument("--cycle-time-ms", type=float, help="Accepted; not read.")
    parser.add_argument("--cache-capacity", type=int, help="Accepted; not read.")
    parser.add_argument(
        "--timeline-filename", help="Sets HOROVOD_TIMELINE for the processes (the timeline file)."
    )
    parser.add_argument(
        "--output-filename",
        help="Folder: each rank's output also goes to DIR/rank.N/stdout and DIR/rank.N/stderr.",
    )
    elastic = parser.add_argument_group(
        "elastic", "Restart the worker group after a failure (see docs/horovod.md)."
    )
    for flag, text in (
        ("--min-np", "The fewest processes (whole hosts' slots on several hosts)."),
        ("--max-np", "The most processes (whole hosts' slots on several hosts)."),
        ("--reset-limit", "Restarts of the worker group after failures (default 3)."),
        ("--slots-per-host", "Slots of a discovered host whose line names none (default 1)."),
    ):
        elastic.add_argument(flag, type=int, help=text)
    elastic.add_argument(
        "--host-discovery-script", help="A command printing HOST:SLOTS lines; run once, at start."
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="The command: python script.py [ARGS...]"
    )
    return parser


def _refuse(args: argparse.Namespace) -> None:
    for key, message in _REFUSED.items():
        if getattr(args, key):
            raise ConfigError(message)
    if args.slots_per_host is not None and args.slots_per_host < 1:
        raise ConfigError(
            f"--slots-per-host must be at least 1, got {args.slots_per_host}; give the "
            "processes each discovered host runs."
        )


def target_of(command: list[str]) -> Target:
    """What each process runs: ``python SCRIPT ARGS``, ``python -m MODULE ARGS`` or
    ``SCRIPT.py ARGS`` run in horovodrun's own interpreter (so dtrain's launcher runs
    them in-process and reports their tracebacks); any other command (a shell script,
    ``pytest``, ``python -c ...``) as a program of its own, with the same variables."""
    words = list(command)
    if words and words[0] == "--":
        words.pop(0)
    if not words:
        raise ConfigError(
            "Give the command to run after the flags, e.g. horovodrun -np 2 python train.py."
        )
    explicit_python = bool(_PYTHON.search(Path(words[0]).name)) or words[0] == sys.executable
    rest = words[1:] if explicit_python else words
    while explicit_python and rest and rest[0] in _PYTHON_SWITCHES:
        rest = rest[1:]
    if explicit_python and rest[:1] == ["-m"] and len(rest) > 1:
        return Target("module", rest[1], tuple(rest[2:]))
    if rest and not rest[0].startswith("-") and (explicit_python or rest[0].endswith(".py")):
        target = Target("script", rest[0], tuple(rest[1:]))
        target.check()
        return target
    program = shutil.which(words[0])
    if program is None:
        raise ConfigError(
            f"horovodrun cannot run {words[0]!r}: no such program on PATH or file; check the "
            "command, e.g. horovodrun -np 2 python train.py."
        )
    return Target("command", program, tuple(words[1:]))


def _hosts_of(args: argparse.Namespace) -> list[Host] | None:
    sources = {
        "-H": args.hosts,
        "--hostfile": args.hostfile,
        "--host-discovery-script": args.host_discovery_script,
    }
    given = [flag for flag, value in sources.items() if value]
    if len(given) > 1:
        raise ConfigError(f"Give only one of {' and '.join(given)}; they all name the hosts.")
    if args.host_discovery_script:
        return discover_hosts(args.host_discovery_script, args.slots_per_host)
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    return None


def _over_ssh(args: argparse.Namespace, hosts: list[Host]) -> Config:
    """The job on several machines: every slot of every host runs a process, started
    over ssh by dtrain's launcher (-p, -i as Horovod's)."""
    total = sum(h.slots for h in hosts)
    if args.np is not None and args.np != total and not is_elastic(args):
        raise ConfigError(
            f"-np {args.np} does not match the {total} slots of "
            f"{', '.join(f'{h.name}:{h.slots}' for h in hosts)}; on several machines every slot "
            f"runs a process, so give -np {total} or change the slots."
        )
    config = Config(
        hosts=[f"{h.name}:{h.slots}" for h in hosts],
        ssh_port=args.ssh_port or 22,
        ssh_identity=args.ssh_identity_file,
        max_restarts=reset_limit(args),
    )
    hosts_of(config)  # the launcher's own checks (equal slots, each host once), now
    return config


def _processes(args: argparse.Namespace, host: Host | None) -> int:
    nproc = local_processes(args, None if host is None else host.slots)
    if nproc is None:
        raise ConfigError(
            "Say how many processes to start with -np N (e.g. horovodrun -np 2 python train.py)."
        )
    if nproc < 1:
        raise ConfigError(f"-np must be at least 1, got {nproc}; pass the number of processes.")
    if is_elastic(args):
        check_counts(args, nproc)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus:
        raise ConfigError(
            f"-np {nproc} asks for more processes than the {gpus} visible GPU(s), and Horovod "
            "scripts pin one GPU per process (hvd.local_rank()); lower -np, or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to train on the CPU."
        )
    if host is not None and nproc > host.slots:
        raise ConfigError(
            f"-np {nproc} asks for more processes than the {host.slots} slot(s) {host.name} "
            f"offers; raise its slots (-H {host.name}:{nproc}) or lower -np."
        )
    return nproc


def _environment(
    args: argparse.Namespace, nproc: int, host: Host | None, many: bool
) -> dict[str, str]:
    """The variables every process shares (the per-rank ones come from the worker; on
    several machines the per-machine ones too, from each host's launcher)."""
    env = {"HOROVOD_SIZE": str(nproc)}
    if not many:
        env |= {
            "HOROVOD_LOCAL_SIZE": str(nproc),
            "HOROVOD_CROSS_RANK": "0",
            "HOROVOD_CROSS_SIZE": "1",
            "HOROVOD_HOSTNAME": host.name if host is not None else "localhost",
        }
    if args.start_timeout is not None:
        env["HOROVOD_START_TIMEOUT"] = str(args.start_timeout)
    if args.gloo_timeout_seconds is not None:
        env[basics.TIMEOUT_VAR] = str(args.gloo_timeout_seconds)
    for key, name in _ACCEPTED_KNOBS.items():
        value = getattr(args, key)
        if value is not None:
            env[name] = str(value)
    if args.fusion_threshold_mb is not None:  # the variable counts bytes, the flag MiB
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = str(Path(args.timeline_filename).resolve())
    if args.output_filename:
        env[OUTPUT_VAR] = str(Path(args.output_filename).resolve())
    return {k: v for k, v in env.items() if v}


@contextlib.contextmanager
def _elastic_folder() -> Iterator[None]:
    """Give the job a folder for `state.commit()` (``DTRAIN_ELASTIC_DIR``), removed when
    the job ends; one the user set is theirs, and kept (a later job resumes from it)."""
    if os.environ.get(durable.DIR_VAR):
        yield
        return
    folder = tempfile.mkdtemp(prefix="horovodrun-elastic-")
    os.environ[durable.DIR_VAR] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _check_build() -> str:
    return "\n".join(
        [
            f"horovodrun on dtrain (Horovod {API_VERSION} API)",
            "",
            "Available frameworks:",
            "    [X] PyTorch",
            "    [ ] TensorFlow",
            "    [ ] MXNet",
            "",
            "Available controllers:",
            "    [ ] MPI",
            "    [X] Gloo",
            "",
            "Available tensor operations:",
            f"    [{'X' if basics.nccl_built() else ' '}] NCCL",
            "    [ ] DDL",
            "    [ ] CCL",
            "    [ ] MPI",
            "    [X] Gloo",
        ]
    )


def run(args: argparse.Namespace) -> None:
    """Launch the command described by parsed `args`; raise DtrainError on bad input or
    LaunchError when a process fails."""
    _refuse(args)
    hosts = _hosts_of(args)
    many = hosts is not None and any(h.name not in local_names() for h in hosts)
    host = None if hosts is None or many else this_machine(hosts)
    min_hosts = None
    if many:
        assert hosts is not None
        config = _over_ssh(args, hosts)
        nproc = sum(h.slots for h in hosts)
        if is_elastic(args):
            min_hosts, _ = machine_range(args, hosts)
    else:
        nproc = _processes(args, host)
        config = Config(nproc=nproc, max_restarts=reset_limit(args))
    target = target_of(args.command)
    if args.gloo_timeout_seconds is not None:
        if not 0 < args.gloo_timeout_seconds <= MAX_TIMEOUT_S:  # false for nan too
            raise ConfigError(
                "--gloo-timeout-seconds must be a number of seconds above 0 and at most "
                f"{MAX_TIMEOUT_S} (a week), got {args.gloo_timeout_seconds:g}; the default "
                "is 600."
            )
        config = config.replace(timeout_s=args.gloo_timeout_seconds)
    saved = dict(os.environ)
    try:
        os.environ.update(_environment(args, nproc, host, many))
        worker = Target("module", "dtrain.horovod.worker", (target.kind, target.name, *target.args))
        with _elastic_folder():
            launch(config, worker, min_hosts=min_hosts)
    finally:
        # horovodrun may run inside another program (tests, a notebook): leave its
        # environment as it was.
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    """The `horovodrun` command; returns its exit code."""
    args = build_parser().parse_args(argv)
    if args.version:
        from dtrain import __version__

        print(f"horovodrun on dtrain {__version__} (Horovod {API_VERSION} API)")
        return 0
    if args.check_build:
        print(_check_build())
        return 0
    with running_as(HOROVODRUN):  # its workers' advice speaks to horovodrun
        try:
            run(args)
        except (DtrainError, KeyboardInterrupt) as e:
            message, code = exit_report(e)
            print(f"horovodrun: {message}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
