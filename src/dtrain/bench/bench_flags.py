"""The flags of `dtrain bench` (strategies x process counts), importable without torch so
that `--help` and every flag error answer at once."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace
from pathlib import Path

from dtrain.command_names import GPT_SIZES, MODELS, OPTIMIZERS, STRATEGY_ALIASES, check_strategy
from dtrain.config import Config
from dtrain.demo.flags import add_expert_args
from dtrain.errors import ConfigError

DEFAULT_STEPS = 30
"""Optimizer steps per demo trial: enough for the first (slow) steps to weigh little."""


def add_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `dtrain bench` when no sub-command (such as `comm`) is given."""
    what = parser.add_argument_group("what to run (one of)")
    what.add_argument(
        "--model",
        default=None,
        choices=MODELS,
        help="Bundled model trained by `dtrain demo` in every trial (default: mlp).",
    )
    what.add_argument(
        "--script",
        type=Path,
        default=None,
        help="Your training script, run by `dtrain run` in every trial; it must build its "
        "Engine with dtrain.init() so that the metrics JSON is written when it ends.",
    )
    what.add_argument(
        "--script-args",
        default="",
        help="Arguments for --script, as one quoted string (split as a shell would).",
    )
    model = parser.add_argument_group("bundled model (as `dtrain demo`)")
    model.add_argument("--model-size", default=None, choices=GPT_SIZES, help="Size of --model gpt.")
    add_expert_args(model)
    model.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per step over all data-parallel workers (default: the model's own).",
    )
    model.add_argument(
        "--optimizer", default=None, choices=OPTIMIZERS, help="Default: the model's own."
    )
    model.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"Optimizer steps per trial (default {DEFAULT_STEPS}); bundled models only: a "
        "script decides its own length through --script-args.",
    )
    grid = parser.add_argument_group("the grid")
    grid.add_argument(
        "--strategies",
        default=None,
        help="Comma-separated strategies to compare, e.g. single,ddp,zero2,zero3; an entry "
        "may carry TOPOLOGY flags of its own, e.g. 'ddp,zero3 --cp 2'.",
    )
    grid.add_argument(
        "--nproc",
        default="1,2",
        help="Comma-separated process counts (default 1,2); a strategy that cannot run at a "
        "count is skipped with the reason in the table.",
    )
    grid.add_argument(
        "--hosts",
        default=None,
        help="Comma-separated machines (names ssh reaches, as for `dtrain run -H`): every "
        "trial runs its --nproc processes on each of them, started from here over ssh, and "
        "the table counts the processes of all of them.",
    )
    grid.add_argument(
        "--ssh-port", type=int, default=None, help="The port sshd listens on, on every host."
    )
    grid.add_argument(
        "--ssh-identity", default=None, help="The private key ssh logs in with, on every host."
    )
    grid.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Trials per configuration (default 3); configurations take turns (A B A B ...) "
        "and the table quotes medians.",
    )
    grid.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="Seconds one trial may take before it is stopped and marked failed (default 600).",
    )
    grid.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of every trial, so all do the same work (default 0).",
    )
    grid.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench"),
        help="Where the table (bench.csv, bench.json), the plots and each trial's log go "
        "(default runs/bench).",
    )


def parse_strategies(text: str | None) -> list[str]:
    """The entries of ``--strategies`` (aliases kept as given), in order, once each: a
    strategy name, optionally followed by TOPOLOGY flags of its own (``zero3 --cp 2``); a
    ConfigError for a missing list, an unknown name or a flag `dtrain run` refuses."""
    if not text:
        raise ConfigError(
            "dtrain bench needs the strategies to compare: give --strategies, e.g. "
            "--strategies single,ddp (or run `dtrain bench comm` for collective bandwidth)."
        )
    entries = list(dict.fromkeys(" ".join(p.split()) for p in text.split(",") if p.strip()))
    canonical = []
    for entry in entries:
        name, flags = entry_parts(entry)
        check_strategy(name)
        entry_config(entry, 1)  # its flags parse (the layout is checked per process count)
        canonical.append((STRATEGY_ALIASES.get(name, name), tuple(flags)))
    if len(set(canonical)) < len(canonical):
        raise ConfigError(
            f"--strategies {text} names the same strategy twice (an alias and its name); "
            "list each once."
        )
    return entries


def entry_parts(entry: str) -> tuple[str, list[str]]:
    """(strategy, its own TOPOLOGY flags) of one ``--strategies`` entry."""
    name, *flags = shlex.split(entry)
    return name, flags


def entry_config(entry: str, nproc: int, hosts: list[str] | None = None) -> Config:
    """The Config one ``--strategies`` entry runs with on `nproc` processes per machine
    (on `hosts`, ``host:slots`` each, if given); a ConfigError naming a flag it refuses."""
    from dtrain.launcher.topology_flags import add_topology_args, config_from

    name, flags = entry_parts(entry)
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_topology_args(parser)
    try:
        args, unknown = parser.parse_known_args(["--strategy", name, "--nproc", str(nproc), *flags])
    except argparse.ArgumentError as e:
        raise ConfigError(f"--strategies entry {entry!r}: {e}.") from None
    if unknown or args.strategy != name or args.nproc != nproc:
        raise ConfigError(
            f"--strategies entry {entry!r} gives {' '.join(unknown) or 'its strategy or --nproc'}, "
            "which an entry cannot: give the strategy first, then TOPOLOGY flags of "
            "`dtrain run` (e.g. 'zero3 --cp 2'); --nproc is the bench's own."
        )
    config = config_from(args)
    return replace(config, hosts=hosts) if hosts else config


def parse_counts(text: str) -> list[int]:
    """The process counts of ``--nproc`` (ascending, once each); a ConfigError when one is
    not a positive whole number."""
    counts: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(
                f"--nproc takes comma-separated process counts of at least 1, such as 1,2,4; "
                f"{part!r} is not one."
            )
        counts.add(int(part))
    if not counts:
        raise ConfigError("--nproc needs at least one process count, such as 1,2.")
    return sorted(counts)


def parse_hosts(text: str | None) -> tuple[str, ...]:
    """The machine names of ``--hosts a,b`` (none: this machine alone)."""
    if not text:
        return ()
    names = [part.strip() for part in text.split(",")]
    if not all(names) or any(":" in name or " " in name for name in names):
        raise ConfigError(
            f"--hosts takes comma-separated machine names, got {text!r}; --nproc sets how "
            "many processes each machine runs, so write e.g. --hosts node-a,node-b."
        )
    if len(set(names)) < len(names):
        raise ConfigError(f"--hosts lists a machine more than once ({text!r}); list each once.")
    return tuple(names)


def check_args(args: argparse.Namespace) -> None:
    """Reject flag combinations `dtrain bench` cannot run, before anything starts."""
    parse_hosts(args.hosts)
    if (args.ssh_port is not None or args.ssh_identity) and not args.hosts:
        raise ConfigError(
            "--ssh-port and --ssh-identity reach the machines of --hosts; give --hosts too, "
            "or drop them to bench this machine alone."
        )
    if args.script is not None:
        if args.model is not None:
            raise ConfigError("Give either --model or --script to dtrain bench, not both.")
        given = [
            flag
            for flag, value in (
                ("--model-size", args.model_size),
                ("--experts", args.experts or None),
                ("--global-batch-size", args.global_batch_size),
                ("--optimizer", args.optimizer),
                ("--steps", args.steps),
            )
            if value is not None
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set(s) the bundled model's training, not a script's; "
                "pass your script's own flags with --script-args instead."
            )
        if not args.script.is_file():
            raise ConfigError(f"The script {args.script} does not exist; check the path.")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}.")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}.")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}.")
    earlier = [name for name in ("bench.json", "bench.csv") if (args.out / name).exists()]
    if earlier:
        raise ConfigError(
            f"--out {args.out} already holds an earlier bench's results ({', '.join(earlier)}, "
            "its plots and logs), which this one would replace. Give another --out (such as "
            f"{args.out}-2), or move {args.out} away first."
        )
