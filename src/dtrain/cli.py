"""The `dtrain` command: run, demo, bench, plan, ckpt.

Parsing, `--help` and every flag or Config error need no torch: this module imports only
light modules at the top, and the launcher, the demo's checks and the checkpoint tools
inside the paths that use them, after the command line has been parsed and checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtrain import __version__
from dtrain.bench.bench_flags import add_args as add_bench_args
from dtrain.bench.comm_flags import add_args as add_comm_args
from dtrain.config import Config
from dtrain.config_file import add_config_arg, parse_with_config
from dtrain.demo_flags import add_training_args
from dtrain.errors import ConfigError, DtrainError, exit_report
from dtrain.flags import add_topology_args, config_from
from dtrain.launch.quiet import import_quietly
from dtrain.plan.flags import add_args as add_plan_args

DEMO_MODULE = "dtrain.demo"
COMM_MODULE = "dtrain.bench.comm"


def build_parser() -> argparse.ArgumentParser:
    """The full `dtrain` argument parser."""
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        prog="dtrain",
        description="Run a one-device PyTorch training loop on many devices by changing one flag.",
    )
    parser.add_argument("--version", action="version", version=f"dtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Launch a training script on every worker.",
        description="Launch SCRIPT (or -m MODULE) under the chosen topology.",
    )
    add_config_arg(run)
    add_topology_args(run)
    run.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="Treat SCRIPT as a module name, as `python -m` does.",
    )
    run.add_argument("script", metavar="SCRIPT", help="The training script (or module with -m).")
    run.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="Arguments for the script."
    )

    demo_parser = sub.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Train a bundled model on real data (digits).",
        description="The main job: train a classifier on scikit-learn's "
        "handwritten digits under any strategy.",
    )
    add_config_arg(demo_parser)
    add_topology_args(demo_parser)
    add_training_args(demo_parser)

    bench = sub.add_parser(
        "bench",
        help="Measure: strategies x process counts side by side (--strategies), or the "
        "collectives' bandwidth (comm).",
        description="Without a sub-command: train the same workload under every strategy "
        "in --strategies at every process count in --nproc, the configurations taking turns, "
        "--repeats times each; write a table (CSV, JSON) of the medians and PNG plots under "
        "--out. `dtrain bench comm` times the collectives instead.",
    )
    add_bench_args(bench)
    # Optional, so that `dtrain bench --strategies ...` runs the strategies bench itself.
    bench_sub = bench.add_subparsers(dest="bench_command", required=False, metavar="{comm}")
    comm = bench_sub.add_parser(
        "comm",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Time all_reduce, reduce_scatter, all_gather, broadcast and send/recv by size.",
        description="Time each collective from --min-bytes to --max-bytes on --nproc "
        "processes; print the algorithm and bus bandwidth (the nccl-tests definitions).",
    )
    add_topology_args(comm)
    add_comm_args(comm)

    plan = sub.add_parser(
        "plan",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="Predict the fastest layout for a model before running it.",
        description="Calibrate on this machine (a short compute probe of the model and a "
        "link probe over --nproc processes), predict each layout's step time and memory "
        "per rank from documented formulas, and list the layouts that fit, best first.",
    )
    add_plan_args(plan)

    ckpt = sub.add_parser("ckpt", help="Inspect, verify or convert checkpoints.")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (
        ("inspect", "Print what a checkpoint (consolidated or sharded) holds."),
        (
            "verify",
            "Check every file of a checkpoint (consolidated or sharded) against its manifest.",
        ),
    ):
        p = ckpt_sub.add_parser(name, help=text, description=text)
        p.add_argument("path", type=Path, help="A checkpoint directory.")
    convert = ckpt_sub.add_parser(
        "convert",
        help="Plain PyTorch file -> checkpoint directory, checkpoint -> plain file, or "
        "sharded checkpoint -> consolidated checkpoint.",
        description="SRC a plain PyTorch or safetensors file (a state_dict, possibly under a "
        "key such as 'state_dict' and with 'module.' names): DST becomes a checkpoint "
        "directory. SRC a checkpoint directory (consolidated or sharded) and DST ending in "
        ".pt/.pth/.bin/.safetensors: DST becomes a plain state_dict file of its model. SRC a "
        "sharded checkpoint and DST a directory: DST becomes a consolidated checkpoint with "
        "the same model, optimizer and trainer state. Runs in this process, without a "
        "process group; files are read with weights_only=True.",
    )
    convert.add_argument("src", type=Path, help="A checkpoint directory or a plain file.")
    convert.add_argument("dst", type=Path, help="The checkpoint directory or file to write.")
    return parser


def _check_demo(config: Config, args: argparse.Namespace) -> None:
    from dtrain import demo
    from dtrain.launch.hosts import as_nodes, hosts_of
    from dtrain.strategies import lookup

    hosts = hosts_of(config)
    if hosts is not None:
        config = as_nodes(config, hosts)

    dp_size, splits = lookup(config.strategy).batch_layout(config)
    demo.complete_args(args)
    demo.check_batch(args.global_batch_size, dp_size, splits, config.grad_accumulation)
    if config.node_rank == 0:
        demo.claim_out(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dtrain` console command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_with_config(build_parser(), argv)
        if args.command == "ckpt":
            return _ckpt(args)
        if args.command == "plan":
            from dtrain.plan.command import main as plan_main

            return plan_main(args)
        if args.command == "bench" and args.bench_command is None:
            from dtrain.bench.strategies import main as bench_strategies

            return bench_strategies(args, argv)
        config = config_from(args)
        if args.command == "bench":
            return _bench(config, argv)
        if args.strategy is None:
            many = config.hosts or config.hostfile
            processes = "every host's processes" if many else f"{config.nproc * config.nnodes}"
            print(
                f"dtrain: strategy {config.strategy} ({processes}"
                f"{'' if many else ' process(es)'}; choose another with --strategy).",
                file=sys.stderr,
                flush=True,
            )
        runner = import_quietly("dtrain.launch.runner")
        Target, launch = runner.Target, runner.launch

        if args.command == "run":
            kind = "module" if args.module else "script"
            launch(config, Target(kind, args.script, tuple(args.script_args)))
        else:
            _check_demo(config, args)
            launch(config, Target("module", DEMO_MODULE, tuple(argv[1:])))
    except (DtrainError, KeyboardInterrupt) as e:
        message, code = exit_report(e)
        print(f"dtrain: {message}", file=sys.stderr)
        return code
    return 0


def _bench(config: Config, argv: list[str]) -> int:
    if config.nproc * config.nnodes < 2:
        raise ConfigError(
            "dtrain bench comm times collectives between processes; give --nproc 2 or more."
        )
    from dtrain.launch.runner import Target, launch

    launch(config, Target("module", COMM_MODULE, tuple(argv[2:])))
    return 0


def _ckpt(args: argparse.Namespace) -> int:
    from dtrain.checkpoint.convert import convert
    from dtrain.checkpoint.verify import summary, verify
    from dtrain.observe.metrics import format_table

    if args.ckpt_command == "convert":
        print(convert(args.src, args.dst))
        return 0
    if args.ckpt_command == "inspect":
        print(format_table(summary(args.path)))
        return 0
    problems = verify(args.path)
    if problems:
        print(
            f"dtrain: {args.path} is damaged:\n  "
            + "\n  ".join(problems)
            + "\nRestore it from a copy, or resume from an older checkpoint.",
            file=sys.stderr,
        )
        return 1
    print(f"{args.path}: every file matches the manifest.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
