"""The `dtrain` command: run, demo, bench, plan, ckpt, data.

Parsing, `--help` and every flag or Config error need no torch: this module imports only
light modules at the top (the parser is `parser.py`, the checks before launching
`preflight.py`), and the launcher, the demo's checks and the checkpoint tools inside the
paths that use them, after the command line has been parsed and checked.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AbstractContextManager, nullcontext

from dtrain.advice import running_as
from dtrain.cli.parser import build_parser
from dtrain.cli.preflight import check_demo, check_run
from dtrain.config import Config
from dtrain.config.file import parse_with_config
from dtrain.demo.flags import check_training_args
from dtrain.errors import ConfigError, DtrainError, exit_report
from dtrain.launcher.quiet import import_quietly
from dtrain.launcher.topology_flags import config_from

DEMO_MODULE = "dtrain.demo"
COMM_MODULE = "dtrain.bench.comm"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dtrain` console command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_with_config(build_parser(), argv)
    except (DtrainError, KeyboardInterrupt) as e:
        return _failed(e)
    # Named for this process and its workers, so that their advice speaks to the command.
    with running_as(args.command):
        try:
            return _command(args, argv)
        except (DtrainError, KeyboardInterrupt) as e:
            return _failed(e)


def _failed(error: DtrainError | KeyboardInterrupt) -> int:
    """Print the line `error` ends the command with; return its exit code."""
    message, code = exit_report(error)
    print(f"dtrain: {message}", file=sys.stderr)
    return code


def _command(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the parsed command; returns the exit code."""
    if args.command == "ckpt":
        return _ckpt(args)
    if args.command == "data":
        return _data(args)
    if args.command == "plan":
        from dtrain.plan.command import main as plan_main

        return plan_main(args)
    if args.command == "bench" and args.bench_command is None:
        from dtrain.bench.strategies import main as bench_strategies

        return bench_strategies(args, argv)
    config = config_from(args)
    if args.command == "bench":
        return _bench(config, argv)
    if args.command == "run":
        check_run(config, args)
    else:
        check_training_args(args)
    runner = import_quietly("dtrain.launcher.runner")
    out_held: AbstractContextManager[object] = nullcontext()
    if args.command == "run":
        kind = "module" if args.module else "script"
        target = runner.Target(kind, args.script, tuple(args.script_args))
    else:
        out_held = check_demo(config, args)
        target = runner.Target("module", DEMO_MODULE, tuple(argv[1:]))
    # --out stays locked while the run lasts, restarts under --max-restarts included
    # (this process outlives them), and is let go however it ends
    with out_held:
        if args.strategy is None:
            many = config.hosts or config.hostfile
            processes = "every host's processes" if many else f"{config.nproc * config.nnodes}"
            print(
                f"dtrain: strategy {config.strategy} ({processes}"
                f"{'' if many else ' process(es)'}; choose another with --strategy).",
                file=sys.stderr,
                flush=True,
            )
        runner.launch(config, target)
    return 0


def _bench(config: Config, argv: list[str]) -> int:
    if config.nproc * config.nnodes < 2:
        raise ConfigError(
            "dtrain bench comm times collectives between processes; give --nproc 2 or more."
        )
    from dtrain.launcher.runner import Target, launch

    launch(config, Target("module", COMM_MODULE, tuple(argv[2:])))
    return 0


def _data(args: argparse.Namespace) -> int:
    from dtrain.data.shard_write import write_shards
    from dtrain.datasets import load_digits, load_text

    train = (load_digits if args.dataset == "digits" else load_text)()[0]
    out = write_shards(train, args.out, args.samples_per_shard, args.partitions, args.format)
    print(
        f"{out}: the {len(train)} training samples of {args.dataset} in {args.partitions} "
        f"partition(s), shards of {args.samples_per_shard} ({args.format})."
    )
    return 0


def _ckpt(args: argparse.Namespace) -> int:
    from dtrain.checkpoint.convert import convert
    from dtrain.checkpoint.verify import read_through, summary, verify
    from dtrain.observe.metrics import format_table

    if args.ckpt_command == "convert":
        print(convert(args.src, args.dst, to=args.to, config=args.hf_config))
        return 0
    if args.ckpt_command == "inspect":
        print(format_table(summary(args.path)))
        return 0
    problems = verify(args.path) or read_through(args.path)
    if problems:
        print(
            f"dtrain: {args.path} is damaged:\n  "
            + "\n  ".join(problems)
            + "\nRestore it from a copy, or resume from an older checkpoint.",
            file=sys.stderr,
        )
        return 1
    print(f"{args.path}: every file matches the manifest and reads.")
    return 0
